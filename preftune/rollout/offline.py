"""Offline GRPO batches: the labeled responses of one prompt form its group; no generation.

The importance ratio is taken against the current policy (old log-probs = logps.detach()), so the
clipped surrogate reduces to an advantage-weighted log-likelihood of the logged responses.
"""
from __future__ import annotations

import torch

from preftune.config import GRPOConfig
from preftune.data.stream import IndexStream
from preftune.data.tensors import left_pad, right_pad
from preftune.data.tokenize import PromptTruncation, encode_prompt, encode_response
from preftune.distributed import Parallel
from preftune.errors import UserError
from preftune.rollout.sampler import Rollout
from preftune.rollout.scored import Scored


class OfflineSource:
    def __init__(self, cfg: GRPOConfig, tokenizer, groups: list, *, seed: int, shuffle: bool,
                 truncation: PromptTruncation, reward_name: str, dp=None):
        self.cfg, self.tok, self.groups, self.truncation = cfg, tokenizer, groups, truncation
        self.dp = dp or Parallel()  # ranks read the same global order and keep their share of it
        self.stream = IndexStream(len(groups), seed, shuffle)
        self.reward_name = reward_name
        self.responses_truncated = 0

    def _encode(self, idx: int):
        g = self.groups[idx]
        p = self.truncation.apply(encode_prompt(self.tok, g.prompt), where=f"group {idx}")
        if p is None:
            return None
        limit = self.cfg.max_completion_length
        comps, cut = [], []
        for r in g.responses:
            ids = encode_response(self.tok, r)
            cut.append(len(ids) > limit)
            comps.append(ids[:limit])
        self.responses_truncated += sum(cut)
        return p, comps, cut, list(g.rewards)

    def _draw(self) -> list:
        """Encoded groups for one step; when data.prompt_truncation=drop leaves none, draw again
        (2 * len consecutive draws cover a whole epoch)."""
        drawn = 0
        while drawn < 2 * len(self.groups):
            n = self.cfg.prompts_per_step
            mine = self.stream.take(n)[self.dp.share(n)]
            encoded = [e for e in map(self._encode, mine) if e is not None]
            if self.dp.sum(len(encoded))[0]:
                return encoded
            drawn += self.cfg.prompts_per_step
        raise UserError(f"every prompt is longer than data.max_prompt_length={self.truncation.max_length} "
                        "and data.prompt_truncation=drop", where="data.max_prompt_length")

    def make_batch(self, model, step: int) -> Scored:
        prompts, comps, cut, rewards, sizes = [], [], [], [], []
        for enc in self._draw():
            p, c, t, r = enc
            prompts += [p] * len(c)
            comps += c
            cut += t
            rewards += r
            sizes.append(len(c))
        p_ids, p_mask = left_pad(prompts, self.tok.pad_token_id)
        c_ids, c_mask = right_pad(comps, self.tok.pad_token_id)
        ro = Rollout(prompt_ids=p_ids, prompt_mask=p_mask, completion_ids=c_ids, completion_mask=c_mask,
                     truncated=torch.tensor(cut, dtype=torch.bool))
        total = torch.tensor(rewards, dtype=torch.float32)  # (N,)
        return Scored(ro, total[:, None].clone(), total, [self.reward_name], sizes)

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
