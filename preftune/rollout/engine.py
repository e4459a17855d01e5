"""The rollout engine: one interface over the own sampler and vLLM, and the one place that picks.

An engine takes token-id prompts and returns token ids with their log-probs (a `Rollout`); it
takes new weights (`push`), sleeps (`sleep`) and wakes (the next `push` wakes it: a sleeping
vLLM engine dropped its weights). Everything above it (online GRPO, the tool loop in
`rollout/agent.py`, evaluation) calls only this interface:

    generate(prompts, positions, *, num_generations, max_new_tokens, eos_id, pad_id, temperature,
             top_p, top_k, greedy, seed, step, round_, turn, generator, model) -> Rollout
    push(model) -> seconds          serving(model, dp) -> context yielding the round's metrics
    sleep()                         tp (ranks that send the same requests), with_logps
    conversation() -> context: the calls inside are turns of the same rows (the tool loop)

`positions`, `seed`, `step`, `round_` and `turn` name each completion's place in the run (vLLM's
per-request seeds); `generator` and `model` are the own sampler's (its random stream, and the
live policy it samples). Each engine ignores what is not its own, so a caller never asks which
engine it holds. A later turn's prompt extends an earlier call's row: both engines prefill only
the new tokens (vLLM by its prefix cache, the own sampler by the caches kept in `conversation`).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from preftune.data.tensors import left_pad
from preftune.rollout.sampler import PrefixCache, Rollout, sample
from preftune.rollout.vllm import VLLMEngine
from preftune.distributed import fsdp


class SamplerEngine:
    """The own sampler (`rollout/sampler.py`) behind the engine interface. It samples the live
    module it is handed, so a push costs nothing; the tokens are those of `sample` itself."""

    tp = 1  # every rank samples its own prompts

    def __init__(self, with_logps: bool = False):
        # off for training: on-policy, the trainer's log-probs are the sampler's
        self.with_logps = with_logps
        self.prefixes: PrefixCache | None = None  # inside `conversation`

    def generate(self, prompts: list[list[int]], positions: list[int] | None = None, *, model,
                 num_generations: int, max_new_tokens: int, eos_id: int, pad_id: int,
                 temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, greedy: bool = False,
                 generator: torch.Generator | None = None,
                 seed: int = 0, step: int = 0, round_: int = 0, turn: int = 0) -> Rollout:
        p_ids, p_mask = left_pad(prompts, pad_id)  # (B, P)
        return sample(model, p_ids, p_mask, num_generations=num_generations,
                      max_new_tokens=max_new_tokens,
                      eos_id=eos_id, pad_id=pad_id, temperature=temperature, top_p=top_p,
                      top_k=top_k, greedy=greedy, generator=generator, with_logps=self.with_logps,
                      prefixes=self.prefixes)

    @contextlib.contextmanager
    def conversation(self):
        """Calls inside are turns of the same rows: each call keeps its rows' keys/values until the
        next, so a later turn prefills only its new tokens. Dropped on exit: the weights change
        between rollouts. Yields the cache (its `reused` counts the tokens not prefilled again)."""
        self.prefixes = PrefixCache()
        try:
            yield self.prefixes
        finally:
            self.prefixes = None

    def push(self, model) -> float:
        return 0.0

    def sleep(self) -> None:
        """Nothing to free: the sampler's caches live only inside `generate`."""

    @contextlib.contextmanager
    def serving(self, model, dp):
        """A generation batch: whole parameters once per rollout under FSDP2, not once per token."""
        with fsdp.whole(model):
            yield {}


def make_engine(cfg, dp=None, model_path: str | None = None):
    """The rollout engine of a run (`cfg`: the whole Config): vLLM with grpo.use_vllm, else the own
    sampler. The only place that reads grpo.use_vllm to choose. vLLM is sized for training's and
    evaluation's prompts and completions; `model_path` starts it on another folder (`preftune
    eval`)."""
    if not cfg.grpo.use_vllm:
        return SamplerEngine()
    longest = max(cfg.grpo.max_completion_length, cfg.eval.max_new_tokens or 0)
    model_cfg = cfg.model if model_path is None else dataclasses.replace(cfg.model,
                                                                         name_or_path=model_path)
    return VLLMEngine(cfg.grpo, model_cfg,
                      max_model_len=cfg.data.max_prompt_length + longest, seed=cfg.seed, dp=dp)
