"""Deterministic, resumable data order."""
from __future__ import annotations

import torch


class IndexStream:
    """An endless shuffled order over n items. The order of epoch e is a function of (seed, e),
    so the position (epoch, offset) is all a checkpoint needs to resume the exact data order."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.offset = 0, 0
        self._cached: tuple[int, list[int]] | None = None

    def _order(self) -> list[int]:
        # one permutation per epoch, not per take
        if self._cached is None or self._cached[0] != self.epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
                order = torch.randperm(self.n, generator=g).tolist()
            else:
                order = list(range(self.n))
            self._cached = (self.epoch, order)
        return self._cached[1]

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
