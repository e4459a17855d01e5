"""The GRPO task for the loop: data source (online or offline), reference model, batch reuse."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from preftune.config import Config
from preftune.data.tokenize import PromptTruncation
from preftune.models import load_model, resolve_model_path
from preftune.rewards.registry import load_reward_function
from preftune.train.grpo import GRPOBatch, grpo_step, new_batch

log = logging.getLogger("preftune")


def load_reward_funcs(cfg: Config, specs: list[str]) -> list:
    return [load_reward_function(s, base_dir=cfg.config_dir, max_completion_length=cfg.grpo.max_completion_length,
                                 overlong_buffer_len=cfg.grpo.overlong_buffer_len) for s in specs]


def trace_options(cfg: Config):
    from preftune.data.traces import TraceOptions

    d = cfg.data
    return TraceOptions(prompt_column=d.prompt_column, response_column=d.response_column,
                        reward_column=d.reward_column, reward_range=tuple(d.reward_range), invalid=d.invalid,
                        duplicates=d.duplicates, min_reward_threshold=d.min_reward_threshold)


def write_data_report(out_dir: str, report: dict) -> None:
    """What the data loaders kept and dropped, in the run folder and in the log (never silent)."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "data_report.json").write_text(json.dumps(report, indent=1))
    log.info("data: %s", json.dumps(report))


def check_prompt_lengths(tokenizer, prompts: list, limit: int, where: str) -> None:
    from preftune.data.tokenize import encode_prompt
    from preftune.errors import UserError

    for i, p in enumerate(prompts):
        n = len(encode_prompt(tokenizer, p))
        if n > limit:
            raise UserError(f"prompt {i} has {n} tokens > data.max_prompt_length={limit} "
                            "(data.prompt_truncation=error)", where=where)


class GRPOTask:
    def __init__(self, cfg: Config, model, tokenizer, device: torch.device, dp=None):
        from preftune.train.distributed import Parallel

        self.cfg, self.g, self.device, self.dp = cfg, cfg.grpo, device, dp or Parallel()
        self.truncation = PromptTruncation(cfg.data.max_prompt_length, cfg.data.prompt_truncation)
        common = dict(seed=cfg.seed, shuffle=cfg.data.shuffle, truncation=self.truncation)
        if self.g.rollout == "online":
            from preftune.data.prompts import load_prompts
            from preftune.rollout.online import OnlineSource

            prompts = load_prompts(cfg.data.train, prompt_column=cfg.data.prompt_column)
            self.source = OnlineSource(self.g, tokenizer, prompts, load_reward_funcs(cfg, self.g.reward_funcs),
                                       device=device, dp=self.dp, **common)
            self.source.state.max_steps = cfg.max_steps  # what TRL's trainer_state.max_steps tells reward functions
            write_data_report(cfg.output_dir, {"prompts": len(prompts)})
        else:
            from preftune.data.groups import build_groups
            from preftune.data.traces import load_traces
            from preftune.rollout.offline import OfflineSource

            traces, drops = load_traces(cfg.data.train, trace_options(cfg))
            groups, greport = build_groups(traces)
            write_data_report(cfg.output_dir, {"traces": drops.as_dict(), "groups": greport.as_dict()})
            if not groups:
                from preftune.errors import UserError

                raise UserError("no usable GRPO group (each needs >= 2 responses with different rewards)",
                                where=cfg.data.train)
            self.source = OfflineSource(self.g, tokenizer, groups, reward_name=cfg.data.reward_column, dp=self.dp,
                                        **common)
        if cfg.data.prompt_truncation == "error":  # fail now, not when the long prompt is drawn hours later
            check_prompt_lengths(tokenizer, prompts.prompts if self.g.rollout == "online" else [g.prompt for g in groups],
                                 cfg.data.max_prompt_length, cfg.data.train)
        self.ref_model = None
        if self.g.beta > 0 and cfg.model.lora.enabled:  # the base under the adapters is the reference
            self.ref_model = model
        elif self.g.beta > 0:  # the reference is only needed for the KL term
            self.ref_model = self.dp.wrap(load_model(cfg.model, resolve_model_path(cfg.model, cfg.config_dir),
                                                     trainable=False))  # sharded like the policy
        self.pending: GRPOBatch | None = None

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
