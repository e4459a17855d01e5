"""The DPO task: pairs from labeled traces (or a pairs file), cached reference log-probs, one step.

Reference log-probs are computed once, before the first step, with the initial policy (which *is*
the reference), and cached in OUTPUT_DIR/ref_logps.pt keyed by a fingerprint of the model and the
tokenised pairs (`algorithms/reference.py`); no reference model is held during training (TRL's
`precompute_ref_log_probs`). With `dpo.precompute_ref_logps: false` a frozen reference (the base
under LoRA adapters) runs on each micro-batch instead.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from preftune.algorithms.reference import cached_reference
from preftune.config import Config, DPOConfig
from preftune.data.pairs import read_pairs
from preftune.data.pipeline import columns, load_pairs
from preftune.data.stream import IndexStream
from preftune.data.tensors import read_once
from preftune.data.tokenize import PromptTruncation
from preftune.data.turns import encode_set
from preftune.distributed.group import Parallel
from preftune.errors import UserError
from preftune.losses.dpo import (TOKEN_SUMS, check_dpo_options, dpo_loss_multi,
                                 implicit_rewards, token_metrics, token_sums, wpo_weights)
from preftune.model.load import to_device
from preftune.model.logps import list_logps, microbatches
from preftune.distributed import fsdp
from preftune.algorithms.router import Routers, reduce_metrics


@dataclass
class EncodedPair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    # per response token, 0 at a tool's output (None: every token counts)
    chosen_mask: list[int] | None = None
    rejected_mask: list[int] | None = None


def encode_pairs(pairs, tokenizer, cfg: Config) -> tuple[list[EncodedPair], dict]:
    """Prompt and response form one sequence; over max_length, the response is cut (prompt kept).
    A multi-turn response counts its assistant turns only (`data/turns.py`)."""
    kept, counts = encode_set(
        tokenizer, ((p.prompt, [p.chosen, p.rejected], p.tools) for p in pairs),
        truncation=PromptTruncation(cfg.data.max_prompt_length, cfg.data.prompt_truncation),
        max_length=cfg.dpo.max_length, tools_file=cfg.data.tools, model=cfg.model.name_or_path,
        label="pair")
    out = [EncodedPair(prompt, c.completion, r.completion, c.mask, r.mask)
           for _, prompt, (c, r) in kept]
    return out, {"pairs": len(out), **counts}


def sequence_logps(model, batch: list[EncodedPair], pad_id: int,
                   device) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed completion log-probs (2b,) and completion lengths (2b,): the b chosen, then the b
    rejected. One pass: chosen_i and rejected_i are next to each other, so the packer can run each
    prompt once with both responses as its branches (`model/logps.py`)."""
    prompts, responses = (
        [e.prompt for e in batch for _ in (0, 1)],
        [r for e in batch for r in (e.chosen, e.rejected)],
    )
    masks = [m for e in batch for m in (e.chosen_mask, e.rejected_mask)]
    # (2b, T), 0 at padding
    logps, _, c_mask = list_logps(model, prompts, responses, pad_id, device, masks=masks)
    sums, counts = logps.sum(-1).view(-1, 2), c_mask.sum(-1).view(-1, 2)  # (b, 2): chosen, rejected
    return sums.t().reshape(-1), counts.t().reshape(-1)


def held_out_pairs(cfg: Config, tokenizer) -> list[EncodedPair]:
    """The encoded pairs of data.eval when it is a pairs file (TRL's eval_dataset), else []."""
    if not cfg.data.eval or not {"chosen", "rejected"} <= set(columns(cfg.data.eval)):
        return []
    encoded, stats = encode_pairs(read_pairs(cfg.data.eval), tokenizer, cfg)
    if not encoded:
        raise UserError(f"no held-out pair left: {stats['prompts_dropped']} dropped by "
                        "data.prompt_truncation",
                        where="data.eval")
    return encoded


def policy_logps(model, batch: list[EncodedPair], pad_id: int, device, *, weighting: bool):
    """`sequence_logps` of the policy, plus the sums behind TRL's per-token metrics (`token_sums`,
    (7,)) and, with `weighting`, each pair's WPO weight w(y_c) w(y_r) (b,) (else None): one pass."""
    b = len(batch)
    prompts, responses = (
        [e.prompt for e in batch for _ in (0, 1)],
        [r for e in batch for r in (e.chosen, e.rejected)],
    )
    # (2b, T), (2b, T, 4)
    logps, stats, mask = list_logps(model, prompts, responses, pad_id, device, stats=True)
    # chosen, rejected
    order = torch.cat([torch.arange(0, 2 * b, 2), torch.arange(1, 2 * b, 2)]).to(logps.device)
    logps, stats, mask = logps[order], stats[order], mask[order].to(logps.dtype)
    weights = None
    if weighting:
        w = wpo_weights(logps.detach(), stats[..., 3], mask)  # (2b,)
        weights = w[:b] * w[b:]  # (b,)
    return logps.sum(-1), mask.sum(-1), token_sums(stats, mask), weights


@torch.no_grad()
def reference_logps(model, encoded: list[EncodedPair], cfg: Config, pad_id: int, device, *,
                    dp: Parallel) -> torch.Tensor:
    """(n, 2) reference [chosen, rejected] log-probs, cached in the output folder
    (`cached_reference`: each rank its share of the pairs, rank 0 reads and writes the cache)."""
    def pair_logps(batch: list[EncodedPair]) -> torch.Tensor:
        lp, _ = sequence_logps(model, batch, pad_id, device)  # (2b,)
        return torch.stack([lp[:len(batch)], lp[len(batch):]], dim=1)  # (b, 2)

    return cached_reference(
        model,
        encoded,
        pair_logps,
        cfg,
        micro_batch_size=cfg.dpo.micro_batch_size,
        what="pairs",
        key_rows=lambda: ((e.prompt, e.chosen, e.rejected, *_masks(e)) for e in encoded),
        dp=dp,
    )


def _masks(e: EncodedPair) -> tuple:
    """The masks where a pair has any (so a cache of unmasked pairs keeps its fingerprint)."""
    return (
        ()
        if e.chosen_mask is None and e.rejected_mask is None
        else (e.chosen_mask, e.rejected_mask)
    )


# summed over micro-batches and ranks, then divided
_SUMS = tuple(f"token_sums/{k}" for k in TOKEN_SUMS)


def loss_types(d: DPOConfig) -> list[str]:
    return [d.loss_type] if isinstance(d.loss_type, str) else list(d.loss_type)


def pair_loss(model, batch: list[EncodedPair], ref: torch.Tensor | None, d: DPOConfig, pad_id: int,
              device) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """The loss of b pairs, their metrics (device tensors, with the token sums) and the policy's
    summed log-probs (2b,: chosen, then rejected); `ref` (b, 2) reference [chosen, rejected]
    log-probs, or None (reference-free)."""
    lp, lengths, sums, pair_w = policy_logps(model, batch, pad_id, device,
                                             weighting=d.use_weighting)  # (2b,), (2b,), (7,), (b,)
    b = len(batch)
    ref_c = ref_r = None
    if ref is not None:
        ref = to_device(ref, lp.device)  # (b, 2)
        ref_c, ref_r = ref[:, 0], ref[:, 1]
    loss, m = dpo_loss_multi(lp[:b], lp[b:], ref_c, ref_r, loss_types=loss_types(d),
                             loss_weights=d.loss_weights,
                             beta=d.beta, label_smoothing=d.label_smoothing,
                             chosen_lengths=lengths[:b],
                             rejected_lengths=lengths[b:], pair_weights=pair_w, sync_metrics=False)
    return loss, m | {"loss": loss.detach()} | dict(zip(_SUMS, sums.unbind())), lp.detach()


def fold_metrics(parts: list, B: int, extra: dict, dp: Parallel,
                 routers: Routers | None = None) -> dict:
    """Micro-batches' metrics (read in one host sync) -> the batch's over every rank: pair means
    by each micro-batch's share b/B, token metrics from their summed parts."""
    totals = dict(extra)
    for (b, _), m in zip(parts, read_once([m for _, m in parts])):
        for k, v in m.items():
            totals[k] = totals.get(k, 0.0) + (v if k in _SUMS else v * b / B)
    totals = reduce_metrics(dp, totals, routers)  # sums over the ranks
    return totals | token_metrics([totals.pop(k, 0.0) for k in _SUMS])


@torch.no_grad()
def evaluate_pairs(model, pairs: list[EncodedPair], ref: torch.Tensor | None,
                   d: DPOConfig, pad_id: int, device,
                   dp: Parallel, live_ref=None) -> tuple[dict, torch.Tensor]:
    """TRL's DPO metrics of held-out pairs (loss, rewards/accuracies, rewards/margins, ...;
    unprefixed) and whether each of this rank's pairs is ranked right (n_share,) 0/1: each rank its
    share of the pairs, in eval mode. `ref` (n, 2) reference log-probs, or None with
    `live_ref(batch) -> (2b,)` (a reference model run on each micro-batch) or neither
    (reference-free)."""
    share = dp.balanced_share(len(pairs))
    mine, parts, right = pairs[share], [], []
    was_training = model.training
    model.eval()
    for sl in microbatches(len(mine), d.micro_batch_size):
        batch = mine[sl]
        r = ref[share][sl] if ref is not None else None
        if r is None and live_ref is not None:
            lr = live_ref(batch)  # (2b,)
            r = torch.stack([lr[:len(batch)], lr[len(batch):]], dim=1)  # (b, 2)
        _, m, lp = pair_loss(model, batch, r, d, pad_id, device)  # lp (2b,)
        r = (None, None) if r is None else to_device(r, lp.device).unbind(1)
        rc, rr = implicit_rewards(lp[:len(batch)], lp[len(batch):], *r, d.beta)  # (b,), (b,)
        right.append(rc > rr)
        parts.append((len(batch), m))
    model.train(was_training)
    return fold_metrics(parts, len(pairs), {}, dp), torch.cat(
        right
    ).float().cpu() if right else torch.zeros(0)


class DPOTask:
    """Builds everything; the loop writes `data_report` once setup has succeeded."""

    engine = agent = None  # evaluation samples with the own sampler, through grpo.tools if any

    def __init__(self, cfg: Config, model, tokenizer, device: torch.device, dp: Parallel):
        self.cfg, self.d, self.device, self.dp = cfg, cfg.dpo, device, dp
        check_dpo_options(loss_types(self.d), self.d.loss_weights, self.d.beta,
                          self.d.label_smoothing)
        pairs, report = load_pairs(cfg)
        self.encoded, stats = encode_pairs(pairs, tokenizer, cfg)
        self.data_report = report | {"encoded": stats}
        if not self.encoded:
            raise UserError(f"no DPO pairs to train on: {stats['prompts_dropped']} dropped by "
                            "data.prompt_truncation",
                            where=cfg.data.train)
        self.pad_id = tokenizer.pad_token_id
        # ref (n, 2): from the checkpoint on a resume, else prepare()
        self.ref, self.ref_model = None, None
        if not self.d.reference_free and not self.d.precompute_ref_logps:
            # run on each batch: the base under LoRA, else a frozen copy, sharded like the policy
            self.ref_model = model if cfg.model.lora.enabled else fsdp.load(
                self.dp, cfg.model, cfg.model.name_or_path, trainable=False)
        self.stream = IndexStream(len(self.encoded), cfg.seed, cfg.data.shuffle)
        self.routers = Routers.of(model, cfg.model.router_aux_loss_coef)
        # TRL's eval_dataset of pairs
        self.held_out, self.eval_ref = held_out_pairs(cfg, tokenizer), None

    def prepare(self, model) -> None:
        """The reference log-probs (of the held-out pairs too), with `model` still holding the
        initial (reference) weights, unless the restored checkpoint brought them."""
        if self.ref is None and not self.d.reference_free and self.d.precompute_ref_logps:
            # each rank computes its share of the pairs on gathered parameters (no collective per
            # pass); the shares are gathered and rank 0 writes the cache
            with fsdp.whole(model):
                ref = reference_logps(model, self.encoded + self.held_out, self.cfg,
                                      self.pad_id, self.device,
                                      dp=self.dp)  # (n + n_eval, 2): one cache
            self.ref, self.eval_ref = ref[:len(self.encoded)], ref[len(self.encoded):]

    def step(self, model, step: int, stop) -> dict:
        idx = self.stream.take(self.d.batch_size)
        B, tokens, parts = len(idx), 0, []  # B: the global batch; this rank trains on its share
        idx = idx[self.dp.even_share(B, "dpo.batch_size")]
        for sl in microbatches(len(idx), self.d.micro_batch_size):
            stop.check()
            part = idx[sl]
            batch = [self.encoded[i] for i in part]
            loss, m = self._pair_loss(model, batch, None if self.ref is None else self.ref[part])
            # per-pair means: a micro-batch of b pairs weighs b/B
            loss = loss * (len(part) / B)
            if self.routers is not None:
                loss = self.routers.added(loss, len(part) / B)
            loss.backward()
            parts.append((len(part), m))
            tokens += sum(2 * len(e.prompt) + len(e.chosen) + len(e.rejected) for e in batch)
        return self._fold(parts, B, {"num_tokens": tokens})

    def _pair_loss(self, model, batch: list[EncodedPair],
                   ref: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """The loss of b pairs and their metrics; `ref` (b, 2) precomputed reference log-probs, else
        the live reference or none."""
        if ref is None and self.ref_model is not None:
            live = self._live_reference(model, batch)  # (2b,)
            ref = torch.stack([live[:len(batch)], live[len(batch):]], dim=1)  # (b, 2)
        return pair_loss(model, batch, ref, self.d, self.pad_id, self.device)[:2]

    def _fold(self, parts: list, B: int, extra: dict) -> dict:
        return fold_metrics(parts, B, extra, self.dp, self.routers)

    def evaluator(self):
        """With held-out pairs (data.eval a pairs file): (model, step) -> TRL's eval metrics of the
        pairs (eval/loss, eval/rewards/accuracies, eval/rewards/margins, ...); else None."""
        return self.evaluate if self.held_out else None

    @torch.no_grad()
    def evaluate(self, model, step: int) -> dict:
        if self.eval_ref is None and self.ref_model is None and not self.d.reference_free:
            raise UserError("the held-out pairs have no reference log-probs in this checkpoint "
                            "(added on a resume?): start over with resume=never", where="data.eval")
        live = None if self.eval_ref is not None or self.ref_model is None else (
            lambda batch: self._live_reference(model, batch))
        m, _ = evaluate_pairs(model, self.held_out, self.eval_ref, self.d, self.pad_id,
                              self.device, self.dp, live)
        return {f"eval/{k}": v for k, v in m.items()} | {"eval/num_pairs": len(self.held_out)}

    @torch.no_grad()
    def _live_reference(self, model, batch: list[EncodedPair]) -> torch.Tensor:
        """Summed reference log-probs (2b,), in eval mode like the precomputed ones."""
        ref = self.ref_model
        with ref.disable_adapter() if ref is model else contextlib.nullcontext():
            was_training = ref.training
            ref.eval()
            lp, _ = sequence_logps(ref, batch, self.pad_id, self.device)
            ref.train(was_training)
        return lp

    def state_dict(self) -> dict:
        # the reference log-probs too: a resume on a fresh node then needs no reference pass
        return {"stream": self.stream.state_dict(), "ref": self.ref, "eval_ref": self.eval_ref}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
        if (
            self.d.precompute_ref_logps
            and state.get("ref") is not None
            and len(state["ref"]) == len(self.encoded)
        ):
            self.ref = state["ref"]
            eval_ref = state.get("eval_ref")
            self.eval_ref = (
                eval_ref if eval_ref is not None and len(eval_ref) == len(self.held_out) else None
            )
