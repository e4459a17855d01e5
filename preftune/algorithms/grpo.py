"""GRPO: build a generation batch (online sampling or offline trace groups), then train on it.

`GRPOTask` is what the loop runs: its data source, the reference model and batch reuse. A generation
batch (`GRPOBatch`) holds the rollout, the advantages and the reference log-probs; it is reused for
`num_iterations` optimiser steps and is part of the checkpoint while pending. `grpo_step` is one
optimiser step's forward/backward over the batch's micro-batches.
"""
from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from dataclasses import dataclass, field

import torch

from preftune.config import Config, GRPOConfig
from preftune.data.pipeline import group_builder, trace_items
from preftune.data.prompts import load_prompts
from preftune.data.split import split_prompt_set
from preftune.data.tensors import read_once
from preftune.data.tokenize import PromptTruncation, encode_prompt
from preftune.data.tools import default_tools
from preftune.data.traces import TraceOptions
from preftune.distributed.group import Parallel
from preftune.errors import UserError
from preftune.losses import grpo_loss
from preftune.losses.advantages import (
    group_advantages,
    group_spread,
    group_std,
    nan_mean_std,
    nanmean,
)
from preftune.losses.grpo import CLIP_KEYS, EXTREMES, ROW_MEANS, batch_normaliser
from preftune.losses.sampling import importance_weights, mismatch_stats, turn_mismatch
from preftune.model.logps import Rows, completion_logps, microbatches
from preftune.model.load import device_of
from preftune.rewards.functions import RewardLog, load_callable, load_reward_funcs
from preftune.rollout.offline import OfflineSource, group_tools
from preftune.rollout.online import OnlineSource
from preftune.rollout.sampler import Rollout
from preftune.rollout.agent import build_agent, dump_trajectories
from preftune.algorithms.router import Routers, reduce_metrics, replay_routes
from preftune.rollout.engine import SamplerEngine, make_engine
from preftune.rollout.scored import Scored
from preftune.distributed import fsdp

log = logging.getLogger("preftune")
TURN_SLOTS = 8  # per-turn mismatch metrics: turns 1..7, and the rest together in the 8th


@dataclass
class GRPOBatch:
    rollout: Rollout
    advantages: torch.Tensor  # (N,)
    ref_logps: torch.Tensor | None  # (N, T)
    metrics: dict = field(default_factory=dict)
    # (N, T) or (N, 1): the engine correction (`losses/sampling.py`)
    is_weights: torch.Tensor | None = None
    # the rollout's sizes, read once for all of the batch's passes (`sizes`)
    rows: Rows | None = None

    def sizes(self) -> Rows:
        """The rollout's `Rows`: one host read, shared by the reference pass and every step on this
        batch."""
        if self.rows is None:
            ro = self.rollout
            self.rows = Rows.read(ro.prompt_ids, ro.prompt_mask, ro.completion_mask)
        return self.rows

    def state_dict(self) -> dict:
        ro = self.rollout
        tensors = {k: getattr(ro, k) for k in Rollout.__slots__ if getattr(ro, k) is not None}
        tensors["advantages"] = self.advantages
        if self.ref_logps is not None:
            tensors["ref_logps"] = self.ref_logps
        if self.is_weights is not None:
            tensors["is_weights"] = self.is_weights
        # references, not copies: the per-step rollback snapshot stays free; torch.save handles
        # devices
        return {"tensors": tensors, "metrics": dict(self.metrics)}

    @classmethod
    def from_state_dict(cls, state: dict, device: torch.device | str = "cpu") -> "GRPOBatch":
        t = {k: v.to(device) for k, v in state["tensors"].items()}
        ro = Rollout(**{k: t.get(k) for k in Rollout.__slots__})
        return cls(rollout=ro, advantages=t["advantages"], ref_logps=t.get("ref_logps"),
                   metrics=state["metrics"], is_weights=t.get("is_weights"))


def reward_metrics(s: Scored, lengths: torch.Tensor, truncated: torch.Tensor) -> dict:
    """Reward and completion metrics of a whole generation batch (`lengths`, `truncated`: (N,)),
    TRL 1.16's names and definitions (NaN = a function that did not apply, left out; stds are
    Bessel-corrected), plus preftune's `reward_group_std` (the mean within-group std)."""
    spread = group_spread(s.total, s.group_sizes)  # (n_groups,)
    m = {"reward": nanmean(s.total), "reward_std": _nanstd(s.total),
         "reward_group_std": spread.mean().item() if spread.numel() else 0.0}
    for j, name in enumerate(s.names):
        m[f"rewards/{name}/mean"] = nanmean(s.per_func[:, j])
        m[f"rewards/{name}/std"] = _nanstd(s.per_func[:, j])
    # (n_groups,): NaN (< 2 valid rewards) is not zero, as in TRL
    std = group_std(s.total, s.group_sizes)
    m["frac_reward_zero_std"] = (
        torch.isclose(std, torch.zeros_like(std)).float().mean().item() if std.numel() else 0.0
    )
    m |= length_metrics(lengths, truncated)
    return m | s.extra | s.log.record()


def _nanstd(x: torch.Tensor) -> float:
    return nan_mean_std(x.reshape(-1), dim=None)[1].item()


def length_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict:
    """TRL's completions/*: mean, min, max length, the share cut at max_completion_length, and the
    lengths of the completions that ended (0 when none did). (N,) -> floats."""
    lengths = lengths.float()
    ended = lengths[~truncated.bool()] if lengths.numel() else lengths
    ended = ended if ended.numel() else lengths.new_zeros(1)
    empty = lengths.numel() == 0
    return {"completions/mean_length": 0.0 if empty else lengths.mean().item(),
            "completions/min_length": 0.0 if empty else lengths.min().item(),
            "completions/max_length": 0.0 if empty else lengths.max().item(),
            "completions/clipped_ratio": 0.0 if empty else truncated.float().mean().item(),
            "completions/mean_terminated_length": ended.mean().item(),
            "completions/min_terminated_length": ended.min().item(),
            "completions/max_terminated_length": ended.max().item()}


def global_view(s: Scored, dp) -> tuple[Scored, torch.Tensor, torch.Tensor, int]:
    """The rewards of the whole generation batch, every rank's rows in rank order (groups never span
    ranks), plus completion lengths and truncation flags (N,), and where this rank's rows start."""
    ro = s.rollout
    mine = (s.total.cpu(), s.per_func.cpu(), list(s.group_sizes),
            ro.loss_mask().sum(-1).cpu(), ro.truncated.cpu(), list(s.names), s.log)
    parts = dp.gather(mine) if dp.active else [mine]
    names = next((p[5] for p in parts if p[5]), s.names)  # a rank with no rows may not know them
    offset = sum(p[0].numel() for p in parts[:dp.rank])
    total, per_func = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    sizes = [g for p in parts for g in p[2]]
    # what the reward functions logged on every rank: TRL's mean over all of it
    logged = RewardLog()
    for p in parts:
        logged.add(p[6])
    whole = Scored(None, per_func, total, names, sizes, s.extra, logged)
    return whole, torch.cat([p[3] for p in parts]), torch.cat([p[4] for p in parts]), offset


def new_batch(s: Scored, model, ref_model, cfg: GRPOConfig, dp: Parallel) -> GRPOBatch:
    """Advantages and reference log-probs, all on the policy's device (rewards are scored on the
    CPU; offline rollouts are built there); old log-probs are left to the batch's first step.
    `ref_model` is None without a KL term, or the policy itself for LoRA (adapters switched off).
    Advantages and reward metrics see the whole generation batch (`dp` gathers every rank's
    rewards); this rank keeps its own rows. The reference pass runs on gathered parameters."""
    device = device_of(model)
    ro = s.rollout.to(device)
    whole, lengths, truncated, offset = global_view(s, dp)
    adv = group_advantages(whole.total, whole.group_sizes, estimator=cfg.advantage_estimator,
                           scale_rewards=cfg.scale_rewards)  # (N_global,)
    adv = adv[offset:offset + ro.completion_ids.size(0)]  # (N_rank,)
    # old log-probs (num_iterations > 1) are not a pass of their own: the batch's first step runs
    # the same weights with grad and records them (`grpo_step`)
    ro.old_logps = None
    batch = GRPOBatch(rollout=ro, advantages=adv.to(device), ref_logps=None,
                      metrics=reward_metrics(whole, lengths, truncated))
    if cfg.beta > 0:
        with fsdp.whole(ref_model):
            batch.ref_logps = rollout_logps(ref_model, ro, cfg, without_adapter=ref_model is model,
                                            rows=batch.sizes())
    # an engine's behaviour log-probs
    if cfg.vllm_importance_sampling_correction and ro.sampling_logps is not None:
        batch.is_weights, stats = engine_correction(model, batch, cfg, dp)
        batch.metrics |= stats
    return batch


def engine_correction(model, batch: GRPOBatch, cfg: GRPOConfig, dp) -> tuple[torch.Tensor, dict]:
    """Importance weights pi_old / mu for the rollout engine's tokens (`losses/sampling.py`): the
    trainer's log-probs of the distribution that drew them (temperature, top-k, top-p, at the
    weights that sampled), against the engine's. Metrics over every rank's tokens, TRL's names."""
    ro = batch.rollout
    with fsdp.whole(model):
        # (N, T)
        trainer = rollout_logps(model, ro, cfg, rows=batch.sizes(), sampling_distribution=True)
    mask = ro.loss_mask().float()  # tool tokens were not sampled: no ratio
    w = importance_weights(trainer, ro.sampling_logps, mask, mode=cfg.vllm_importance_sampling_mode,
                           clip_min=cfg.vllm_importance_sampling_clip_min,
                           clip_max=cfg.vllm_importance_sampling_clip_max)
    (st,) = read_once([mismatch_stats(trainer, ro.sampling_logps, mask, w)])  # one host read
    d_sum, d_n, r_sum, r_n = dp.sum(st["diff_sum"], st["diff_count"],
                                    st["ratio_sum"], st["ratio_count"])
    d_max, r_max, neg_r_min = dp.max(st["diff_max"], st["ratio_max"], -st["ratio_min"])
    pre = "sampling/"
    metrics = {f"{pre}sampling_logp_difference/mean": d_sum / max(d_n, 1.0),
               f"{pre}sampling_logp_difference/max": d_max,
               f"{pre}importance_sampling_ratio/min": -neg_r_min if r_n else 0.0,
               f"{pre}importance_sampling_ratio/mean": r_sum / r_n if r_n else 0.0,
               f"{pre}importance_sampling_ratio/max": r_max if r_n else 0.0}
    if ro.tool_mask is not None:  # per assistant turn: a mismatch that grows with the turn shows
        turns = (cfg.max_tool_calling_iterations or TURN_SLOTS - 1) + 1  # a re-tokenized history
        per = turn_mismatch(trainer, ro.sampling_logps, mask, ro.tool_mask, min(turns, TURN_SLOTS))
        sums = dp.sum(*per.flatten().tolist())
        for k in range(per.size(0)):
            if sums[2 * k + 1] > 0:
                metrics[f"{pre}sampling_logp_difference/turn_{k + 1}"] = (
                    sums[2 * k] / sums[2 * k + 1])
    return w, metrics


@torch.no_grad()
def rollout_logps(model, rollout: Rollout, cfg: GRPOConfig, *, without_adapter: bool = False,
                  rows: Rows | None = None, sampling_distribution: bool = False) -> torch.Tensor:
    """Log-probs (N, T) of a rollout's completions under `model`, no grad: the reference's (with
    LoRA the policy with its adapters disabled: no second model in memory), or with
    `sampling_distribution` the policy's own sampling distribution (top-k/top-p renormalised), which
    the engine correction compares with the engine's."""
    with model.disable_adapter() if without_adapter else contextlib.nullcontext():
        out = []
        if rows is None:  # one host read
            rows = Rows.read(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_mask)
        for sl in microbatches(rollout.completion_ids.size(0), cfg.micro_batch_size):
            lp, _ = completion_logps(model, rollout.prompt_ids[sl], rollout.prompt_mask[sl],
                                     rollout.completion_ids[sl], rollout.completion_mask[sl],
                                     temperature=cfg.temperature, rows=rows[sl],
                                     top_k=cfg.top_k if sampling_distribution else 0,
                                     top_p=cfg.top_p if sampling_distribution else 1.0,
                                     routes=None if rollout.routes is None else rollout.routes[sl])
            out.append(lp)  # (b, T)
    return torch.cat(out)  # (N, T)


def trained_rows(advantages: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor | None:
    """Rows whose forward/backward can move the policy (N',), or None for all of them.

    A row without counted tokens adds nothing to any loss. With beta = 0 every row's term is its
    advantage times a factor (each loss type, both ratio levels), so a row with advantage exactly
    0 has zero loss and gradient too. Both are skipped; the normaliser stays the whole batch's
    (`batch_normaliser`: its sequences and tokens), so the update is the same. One host sync: the
    row list."""
    live = mask.sum(1) > 0  # (N,)
    if beta == 0:
        live &= advantages != 0
    keep = live.nonzero().squeeze(1)  # (N',)
    return None if keep.numel() == live.numel() else keep


@dataclass
class StepRows:
    """The rows of a generation batch that a step runs (`trained_rows`), cut from it once, and the
    whole batch's counts. Every micro-batch divides by the whole batch's normaliser, so the summed
    gradient is one pass over the whole batch whatever rows are left out; with data parallel the
    counts are global (every rank's rows)."""

    prompt_ids: torch.Tensor  # (n, P)
    prompt_mask: torch.Tensor  # (n, P)
    completion_ids: torch.Tensor  # (n, T)
    completion_mask: torch.Tensor  # (n, T)
    mask: torch.Tensor  # (n, T) the counted tokens: sampled, and not cut when that is masked
    advantages: torch.Tensor  # (n,)
    old_logps: torch.Tensor | None  # (n, T)
    ref_logps: torch.Tensor | None  # (n, T)
    is_weights: torch.Tensor | None  # (n, T) or (n, 1)
    routes: torch.Tensor | None  # (n, P+T, S, k) the sampler's experts (`Rollout.routes`)
    rows: Rows
    tokens: list[float]  # each row's counted tokens
    keep: torch.Tensor | None  # the rows' places in the batch (None: every row)
    skipped: int  # rows left out
    skipped_with_tokens: bool  # a left-out row has counted tokens (advantage 0, beta 0)
    batch_seqs: int
    batch_tokens: float
    run_tokens: float  # the counted tokens of the rows run
    normaliser: float  # `batch_normaliser` of the whole batch


def step_rows(batch: GRPOBatch, cfg: GRPOConfig, dp: Parallel) -> StepRows:
    """`StepRows` of a batch: one host read of each row's tokens, one of the kept rows."""
    ro = batch.rollout
    mask = ro.loss_mask().float()  # (N, T) a tool's result is out of every term and count
    if cfg.mask_truncated_completions:
        mask = mask * (~ro.truncated).float()[:, None]
    tokens = mask.sum(1).tolist()
    seqs, total = dp.sum(len(tokens), sum(tokens))
    keep = trained_rows(batch.advantages, mask, cfg.beta)
    kept = list(range(len(tokens))) if keep is None else keep.tolist()

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return t if t is None or keep is None else t.index_select(0, keep)

    row_tokens = [tokens[i] for i in kept]
    skipped = len(tokens) - len(kept)
    return StepRows(
        *(pick(t) for t in (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask,
                            mask, batch.advantages, ro.old_logps, batch.ref_logps,
                            batch.is_weights, ro.routes)),
        rows=batch.sizes() if keep is None else batch.sizes()[kept], tokens=row_tokens,
        keep=keep, skipped=skipped, skipped_with_tokens=skipped > tokens.count(0.0),
        batch_seqs=int(seqs), batch_tokens=total, run_tokens=dp.sum(sum(row_tokens))[0],
        normaliser=batch_normaliser(cfg.loss_type, batch_seqs=int(seqs), batch_tokens=total,
                                    max_completion_length=cfg.max_completion_length))


def grpo_step(model, batch: GRPOBatch, cfg: GRPOConfig, check=lambda: None, *,
              dp: Parallel, routers: Routers | None = None) -> dict:
    """Forward/backward over micro-batches of the rows that can move the policy (`step_rows`);
    the caller steps the optimizer. `rows_skipped` counts the rows left out and `entropy` is over
    the rows run. Tested: 2 ranks equal 1 process, micro-batch splits equal one pass, skipping
    equals not skipping."""
    s = step_rows(batch, cfg, dp)
    ro = batch.rollout
    record = cfg.num_iterations > 1 and ro.old_logps is None  # the first of the batch's steps
    parts, recorded = [], []  # per micro-batch (slice, metric tensors), read once after the loop
    slices = list(microbatches(s.mask.size(0), cfg.micro_batch_size))
    for _ in range(int(dp.max(len(slices))[0]) - len(slices)):  # FSDP: as many passes per rank
        check()
        idle_pass(model, ro)
        if routers is not None:  # a padding token's routes: no part of the batch
            routers.record.take()
    for sl in slices:
        check()  # preemption: may abandon the step between micro-batches
        logps, entropy = completion_logps(model, s.prompt_ids[sl], s.prompt_mask[sl],
                                          s.completion_ids[sl], s.completion_mask[sl],
                                          temperature=cfg.temperature, with_entropy=True,
                                          rows=s.rows[sl],
                                          routes=None if s.routes is None else s.routes[sl])
        if record:  # the policy that sampled this batch, as its later steps' old log-probs
            recorded.append(logps.detach())
        old = None if record or s.old_logps is None else s.old_logps[sl]
        loss, m = grpo_loss(logps, old, None if s.ref_logps is None else s.ref_logps[sl],
                            s.advantages[sl], s.mask[sl], loss_type=cfg.loss_type,
                            beta=cfg.beta, epsilon=cfg.epsilon,
                            epsilon_high=cfg.epsilon_high, delta=cfg.delta,
                            importance_sampling_level=cfg.importance_sampling_level,
                            normaliser=s.normaliser,
                            kl_ratio_correction=cfg.use_bias_correction_kl, sync_metrics=False,
                            importance_weights=None if s.is_weights is None else s.is_weights[sl],
                            vespo=vespo_options(cfg))
        if routers is not None:
            loss = routers.added(loss, (sl.stop - sl.start) / max(s.batch_seqs, 1))
        loss.backward()
        parts.append((sl, m | {"loss": loss.detach(),
                               "entropy_sum": (entropy.detach() * s.mask[sl]).sum()}))
    totals, ent_sum = _fold(parts, s.tokens, s.batch_tokens, s.batch_seqs,
                            by_rows=cfg.importance_sampling_level == "sequence")
    if record:  # only once the step is whole: an abandoned step leaves the batch as it was
        ro.old_logps = _scatter_rows(recorded, s.keep, ro.completion_mask)
    if s.skipped:
        _skipped_rows(model, totals, s, cfg)
    totals["entropy"] = ent_sum / max(s.run_tokens, 1.0)
    totals["rows_skipped"] = float(s.skipped)
    return reduce_metrics(dp, totals, routers, EXTREMES)


def _skipped_rows(model, totals: dict, s: StepRows, cfg: GRPOConfig) -> None:
    """What the rows left out add, as if they had run: zero gradients (every row skipped: the
    optimiser still steps on zeros), zero loss and clip fractions, and a per-row clip fraction of 0
    for a left-out row with tokens (it is never clipped)."""
    _zero_missing_grads(model)
    for k in ("loss", "kl", *(f"clip_ratio/{c}" for c in CLIP_KEYS)):
        totals.setdefault(k, 0.0)
    if cfg.beta == 0 and s.skipped_with_tokens:
        totals["clip_ratio/low_min"] = min(totals["clip_ratio/low_min"], 0.0)


def _scatter_rows(parts: list[torch.Tensor], keep: torch.Tensor | None,
                  like: torch.Tensor) -> torch.Tensor:
    """The trained rows' log-probs back at their rows of the batch (N, T). A skipped row stays 0: it
    is skipped again on every later step of the batch (same advantage, same beta), so never read."""
    # (N', T)
    rows = torch.cat(parts) if parts else like.new_zeros((0, like.size(1)), dtype=torch.float32)
    if keep is None:
        return rows
    out = rows.new_zeros(like.shape)  # (N, T)
    return out.index_copy(0, keep, rows)


def idle_pass(model, ro: Rollout) -> None:
    """A zero-weight forward/backward on one padding token: a rank with fewer micro-batches than the
    others joins their FSDP all-gathers and reduce-scatters without changing any gradient."""
    one = torch.ones((1, 1), dtype=ro.prompt_ids.dtype, device=ro.prompt_ids.device)
    logps, _ = completion_logps(model, one, one, one, one, rows=Rows([1], [1], [1]))
    (logps.sum() * 0.0).backward()


def _fold(parts: list, row_tokens: list[float], batch_tokens: float, batch_seqs: int, *,
          by_rows: bool) -> tuple[dict, float]:
    """The micro-batches' metrics (read in one host sync) folded into the batch's (`_accumulate`)
    -> (totals, entropy summed over tokens)."""
    totals, ent_sum = {}, 0.0
    for (sl, _), m in zip(parts, read_once([stats for _, stats in parts])):
        loss, ent = m.pop("loss"), m.pop("entropy_sum")
        _accumulate(totals, m, loss, token_share=sum(row_tokens[sl]) / max(batch_tokens, 1.0),
                    row_share=(sl.stop - sl.start) / batch_seqs, by_rows=by_rows)
        ent_sum += ent
    return totals, ent_sum


def _accumulate(totals: dict, m: dict, loss: float, *, token_share: float, row_share: float,
                by_rows: bool) -> None:
    """Fold one micro-batch's metrics into the batch's: token means by token share (GSPO's clip
    ratios, means over sequences, by row share), extremes by min/max, the loss (already the
    micro-batch's share of the batch's) by its sum."""
    totals["loss"] = totals.get("loss", 0.0) + loss
    for k, v in m.items():
        if isinstance(v, float) and math.isnan(v):
            continue
        if k in EXTREMES:  # combine by min/max, not by averaging
            totals[k] = EXTREMES[k](totals[k], v) if k in totals else v
        else:
            rows = by_rows and k.startswith("clip_ratio/") or k in ROW_MEANS
            totals[k] = totals.get(k, 0.0) + v * (row_share if rows else token_share)


def vespo_options(cfg: GRPOConfig) -> dict[str, float]:
    """VESPO's k and lambda per advantage sign, from the config (TRL's vespo_* keys)."""
    return {"k_pos": cfg.vespo_k_pos, "lambda_pos": cfg.vespo_lambda_pos, "k_neg": cfg.vespo_k_neg,
            "lambda_neg": cfg.vespo_lambda_neg}


def _zero_missing_grads(model) -> None:
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def check_prompt_lengths(tokenizer, prompts: list, limit: int, where: str) -> None:
    for i, p in enumerate(prompts):
        n = len(encode_prompt(tokenizer, p))
        if n > limit:
            raise UserError(f"prompt {i} has {n} tokens > data.max_prompt_length={limit} "
                            "(data.prompt_truncation=error)", where=where)


def start_engine(cfg: Config, dp=None):
    """The rollout engine beside this rank's trainer (`rollout/engine.make_engine`): tests replace
    it here."""
    return make_engine(cfg, dp)


class GRPOTask:
    """Builds everything and writes nothing: the loop writes `data_report` once setup has
    succeeded."""

    def __init__(self, cfg: Config, model, tokenizer, device: torch.device, dp: Parallel):
        self.cfg, self.g, self.device, self.dp = cfg, cfg.grpo, device, dp
        self.tokenizer = tokenizer
        self.truncation = PromptTruncation(cfg.data.max_prompt_length, cfg.data.prompt_truncation)
        common = dict(seed=cfg.seed, shuffle=cfg.data.shuffle, truncation=self.truncation)
        if self.g.rollout == "online":
            prompts = load_prompts(cfg.data.train, prompt_column=cfg.data.prompt_column)
            held_out = {}
            if cfg.eval.split:  # the held-out prompts are for evaluation only
                n, prompts = len(prompts), split_prompt_set(prompts, cfg.eval.split, held_out=False)
                held_out = {"held_out_prompts": n - len(prompts)}
            funcs = load_reward_funcs(self.g.reward_funcs, self.g, cfg.config_dir, device=device)
            self.engine = start_engine(cfg, self.dp)
            # None without tools or an environment
            self.agent = agent = build_agent(self.g, tokenizer, cfg.config_dir)
            custom = load_callable(self.g.rollout_func, cfg.config_dir, "grpo.rollout_func") \
                if self.g.rollout_func else None
            self.source = OnlineSource(self.g, tokenizer, prompts, funcs, device=device, dp=self.dp,
                                       engine=self.engine, agent=agent,
                                       rollout_func=custom, **common)
            # what TRL's trainer_state.max_steps tells reward functions
            self.source.state.max_steps = cfg.max_steps
            self.data_report = {"prompts": len(prompts)} | held_out
            texts = prompts.prompts
        else:
            # samples nothing: its `serving` gathers FSDP2 parameters once
            self.engine, self.agent = SamplerEngine(), None
            groups, self.data_report = trace_items(cfg.data.train,
                                                   TraceOptions.from_config(cfg.data), "groups",
                                                   group_builder, split=cfg.eval.split)
            tools = default_tools(tokenizer, cfg.data.tools, cfg.model.name_or_path,
                                  map(group_tools, groups))
            self.source = OfflineSource(self.g, tokenizer, groups,
                                        reward_name=cfg.data.reward_column, dp=self.dp,
                                        tools=tools, **common)
            texts = [g.prompt for g in groups]
        # fail now, not when the long prompt is drawn hours later
        if cfg.data.prompt_truncation == "error":
            check_prompt_lengths(tokenizer, texts, cfg.data.max_prompt_length, cfg.data.train)
        self.ref_model = None
        # the base under the adapters is the reference
        if self.g.beta > 0 and cfg.model.lora.enabled:
            self.ref_model = model
        elif self.g.beta > 0:  # the reference is only needed for the KL term
            self.ref_model = fsdp.load(self.dp, cfg.model, cfg.model.name_or_path, trainable=False)
        self.pending: GRPOBatch | None = None
        self.routers = Routers.of(model, cfg.model.router_aux_loss_coef)
        if self.g.routing_replay:
            replay_routes(model, self.ref_model)

    def prepare(self, model) -> None:
        """Nothing to compute from the initial weights (the reference model, if any, is loaded)."""

    def evaluator(self) -> None:
        """The run's held-out prompts, sampled by this task's engine through its agent."""

    def step(self, model, step: int, stop) -> dict:
        if self.pending is None or (step - 1) % self.g.num_iterations == 0:
            with self.engine.serving(model, self.dp) as extra:  # vLLM: a push first, a sleep after
                scored = self.source.make_batch(model, step)
            scored.extra = scored.extra | extra
            if self.g.log_trajectories and scored.trajectories and self.dp.rank == 0:
                dump_trajectories(Path(self.cfg.output_dir) / "trajectories.jsonl", step,
                                  scored, self.tokenizer, self.g.log_trajectories)
            stop.check()
            self.pending = new_batch(scored, model, self.ref_model, self.g, self.dp)
        m = grpo_step(model, self.pending, self.g, check=stop.check, dp=self.dp,
                      routers=self.routers)
        m.update(self.pending.metrics)
        ro = self.pending.rollout
        tokens, truncated, dropped = self.dp.sum(
            float(ro.completion_mask.sum() + ro.prompt_mask.sum()),
            self.truncation.truncated,
            self.truncation.dropped,
        )
        m["num_tokens"], m["prompts_truncated"], m["prompts_dropped"] = (
            int(tokens),
            int(truncated),
            int(dropped),
        )
        return m

    def state_dict(self) -> dict:
        reuse = self.pending is not None and self.g.num_iterations > 1
        return {
            "source": self.source.state_dict(),
            "pending": self.pending.state_dict() if reuse else None,
            "truncation": [
                self.truncation.truncated,
                self.truncation.dropped,
                sorted(self.truncation.seen),
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state["source"])
        pending = state["pending"]
        self.pending = (
            GRPOBatch.from_state_dict(pending, self.device) if pending is not None else None
        )
        t, d, seen = state["truncation"]
        self.truncation.truncated, self.truncation.dropped, self.truncation.seen = t, d, set(seen)
