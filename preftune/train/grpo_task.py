"""The GRPO task for the loop: data source (online or offline), reference model, batch reuse."""
from __future__ import annotations

import logging

import torch

from preftune.config import Config
from preftune.data.tokenize import PromptTruncation, encode_prompt
from preftune.errors import UserError
from preftune.rewards.registry import load_reward_funcs
from preftune.train.grpo import GRPOBatch, grpo_step, new_batch

log = logging.getLogger("preftune")


def check_prompt_lengths(tokenizer, prompts: list, limit: int, where: str) -> None:
    for i, p in enumerate(prompts):
        n = len(encode_prompt(tokenizer, p))
        if n > limit:
            raise UserError(f"prompt {i} has {n} tokens > data.max_prompt_length={limit} "
                            "(data.prompt_truncation=error)", where=where)


class GRPOTask:
    """Builds everything and writes nothing: the loop writes `data_report` once setup has succeeded."""

    def __init__(self, cfg: Config, model, tokenizer, device: torch.device, dp=None):
        from preftune.train.distributed import Parallel

        self.cfg, self.g, self.device, self.dp = cfg, cfg.grpo, device, dp or Parallel()
        self.truncation = PromptTruncation(cfg.data.max_prompt_length, cfg.data.prompt_truncation)
        common = dict(seed=cfg.seed, shuffle=cfg.data.shuffle, truncation=self.truncation)
        if self.g.rollout == "online":
            from preftune.data.prompts import load_prompts
            from preftune.rollout.online import OnlineSource

            prompts = load_prompts(cfg.data.train, prompt_column=cfg.data.prompt_column)
            held_out = {}
            if cfg.eval.split:  # the held-out prompts are for evaluation only
                from preftune.data.split import split_prompt_set

                n, prompts = len(prompts), split_prompt_set(prompts, cfg.eval.split, held_out=False)
                held_out = {"held_out_prompts": n - len(prompts)}
            funcs = load_reward_funcs(self.g.reward_funcs, self.g, cfg.config_dir)
            self.source = OnlineSource(self.g, tokenizer, prompts, funcs, device=device, dp=self.dp, **common)
            self.source.state.max_steps = cfg.max_steps  # what TRL's trainer_state.max_steps tells reward functions
            self.data_report = {"prompts": len(prompts)} | held_out
            texts = prompts.prompts
        else:
            from preftune.data.groups import build_groups
            from preftune.data.split import drop_held_out
            from preftune.data.traces import TraceOptions, load_traces, dropped_note
            from preftune.rollout.offline import OfflineSource

            traces, drops = load_traces(cfg.data.train, TraceOptions.from_config(cfg.data))
            traces, held_out = drop_held_out(list(traces), cfg.eval.split)
            groups, greport = build_groups(traces)
            self.data_report = {"traces": drops.as_dict(), "groups": greport.as_dict()} | (
                {"held_out_rows": held_out} if cfg.eval.split else {})
            if not groups:
                raise UserError("no usable GRPO group (each needs >= 2 responses with different rewards; "
                                f"{greport.too_small} prompts too small, {greport.zero_spread} with equal rewards)"
                                + dropped_note(drops), where=cfg.data.train)
            self.source = OfflineSource(self.g, tokenizer, groups, reward_name=cfg.data.reward_column, dp=self.dp,
                                        **common)
            texts = [g.prompt for g in groups]
        if cfg.data.prompt_truncation == "error":  # fail now, not when the long prompt is drawn hours later
            check_prompt_lengths(tokenizer, texts, cfg.data.max_prompt_length, cfg.data.train)
        self.ref_model = None
        if self.g.beta > 0 and cfg.model.lora.enabled:  # the base under the adapters is the reference
            self.ref_model = model
        elif self.g.beta > 0:  # the reference is only needed for the KL term
            self.ref_model = self.dp.load(cfg.model, cfg.model.name_or_path, trainable=False)
        self.pending: GRPOBatch | None = None

    def prepare(self, model) -> None:
        """Nothing to compute from the initial weights (the reference model, if any, is loaded)."""

    def step(self, model, step: int, stop) -> dict:
        if self.pending is None or (step - 1) % self.g.num_iterations == 0:
            with self.dp.gathered(model):  # sampling: whole parameters once per rollout, not per token
                scored = self.source.make_batch(model, step)
            stop.check()
            self.pending = new_batch(scored, model, self.ref_model, self.g, self.dp)
        m = grpo_step(model, self.pending, self.g, check=stop.check, dp=self.dp)
        m.update(self.pending.metrics)
        ro = self.pending.rollout
        tokens, truncated, dropped = self.dp.sum(float(ro.completion_mask.sum() + ro.prompt_mask.sum()),
                                                 self.truncation.truncated, self.truncation.dropped)
        m["num_tokens"], m["prompts_truncated"], m["prompts_dropped"] = int(tokens), int(truncated), int(dropped)
        return m

    def state_dict(self) -> dict:
        reuse = self.pending is not None and self.g.num_iterations > 1
        return {"source": self.source.state_dict(), "pending": self.pending.state_dict() if reuse else None,
                "truncation": [self.truncation.truncated, self.truncation.dropped, sorted(self.truncation.seen)]}

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state["source"])
        pending = state["pending"]
        self.pending = GRPOBatch.from_state_dict(pending, self.device) if pending is not None else None
        t, d, seen = state["truncation"]
        self.truncation.truncated, self.truncation.dropped, self.truncation.seen = t, d, set(seen)
