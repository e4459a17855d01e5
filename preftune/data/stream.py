"""Deterministic, resumable data order."""
from __future__ import annotations

import torch


class IndexStream:
    """An endless shuffled order over n items. The order of epoch e is a function of (seed, e),
    so the position (epoch, offset) is all a checkpoint needs to resume the exact data order."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.offset = 0, 0

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            order = self._order()
            chunk = order[self.offset:self.offset + k - len(out)]
            out += chunk
            self.offset += len(chunk)
            if self.offset >= self.n:
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
