"""Offline GRPO batches: the labeled responses of one prompt form its group; no generation.

The importance ratio is taken against the current policy (old log-probs = logps.detach()), so the
clipped surrogate reduces to an advantage-weighted log-likelihood of the logged responses. A
multi-turn response (assistant -> tool -> assistant) is encoded by `data/turns.py`: the tokens a
tool wrote go into the rollout's `tool_mask` as 0, so they are out of the loss and its sums.
"""
from __future__ import annotations

import torch

from preftune.config import GRPOConfig
from preftune.data.stream import IndexStream
from preftune.data.tensors import left_pad, right_pad
from preftune.data.tokenize import PromptTruncation
from preftune.data.tools import TOOLS_COLUMN
from preftune.data.turns import encode_row
from preftune.distributed.group import Parallel
from preftune.errors import UserError
from preftune.rollout.sampler import Rollout
from preftune.rollout.scored import Scored


class OfflineSource:
    def __init__(self, cfg: GRPOConfig, tokenizer, groups: list, *, seed: int, shuffle: bool,
                 truncation: PromptTruncation, reward_name: str, dp: Parallel,
                 tools: list[dict] | None = None):
        """`tools`: the set's tool schemas (`data.tools`), for groups whose rows have none."""
        self.cfg, self.tok, self.groups, self.truncation = cfg, tokenizer, groups, truncation
        self.tools = tools
        self.dp = dp  # ranks read the same global order and keep their share of it
        self.stream = IndexStream(len(groups), seed, shuffle)
        self.reward_name = reward_name

    def _encode(self, idx: int):
        g = self.groups[idx]
        tools = group_tools(g) or self.tools
        rows = [
            encode_row(self.tok, g.prompt, r, tools=tools, where=f"group {idx}")
            for r in g.responses
        ]
        p = self.truncation.apply(rows[0].prompt, where=f"group {idx}")
        if p is None:
            return None
        limit = self.cfg.max_completion_length
        cut = [len(r.completion) > limit for r in rows]
        return p, [r.cut(limit) for r in rows], cut, list(g.rewards)

    def _draw(self) -> list:
        """Encoded groups for one step; when data.prompt_truncation=drop leaves none, draw again
        (2 * len consecutive draws cover a whole epoch)."""
        drawn = 0
        while drawn < 2 * len(self.groups):
            n = self.cfg.prompts_per_step
            mine = self.stream.take(n)[self.dp.balanced_share(n)]
            encoded = [e for e in map(self._encode, mine) if e is not None]
            if self.dp.sum(len(encoded))[0]:
                return encoded
            drawn += self.cfg.prompts_per_step
        raise UserError("every prompt is longer than "
                        f"data.max_prompt_length={self.truncation.max_length} and "
                        "data.prompt_truncation=drop", where="data.max_prompt_length")

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
        c_ids, c_mask = right_pad([c.completion for c in comps], self.tok.pad_token_id)
        tool_mask = None
        # (N, T) 0 at a tool's tokens; padding is out by c_mask
        if any(c.mask is not None for c in comps):
            tool_mask, _ = right_pad(
                [[1] * len(c.completion) if c.mask is None else c.mask for c in comps], 1
            )
            tool_mask = tool_mask.masked_fill(c_mask == 0, 1)
        ro = Rollout(prompt_ids=p_ids, prompt_mask=p_mask, completion_ids=c_ids,
                     completion_mask=c_mask,
                     truncated=torch.tensor(cut, dtype=torch.bool), tool_mask=tool_mask)
        total = torch.tensor(rewards, dtype=torch.float32)  # (N,)
        return Scored(ro, total[:, None].clone(), total, [self.reward_name], sizes)

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])


def group_tools(group) -> list[dict] | None:
    """A group's tool schemas: its first row's `tools` column (one prompt, one set of tools)."""
    return group.extras[0].get(TOOLS_COLUMN) if group.extras else None
