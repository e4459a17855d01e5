"""The KTO task: labeled responses from traces, fixed batches with TRL's mismatched pairs, cached
reference log-probs, one step (the loss: `losses/kto.py`).

Batches are fixed at setup: one seeded order of the examples (data.shuffle) cut into kto.batch_size,
the last filled up from the next order, so every batch is full; each epoch visits the batches in a
new seeded order. In batch [e_0, ..., e_{B-1}] slot k's mismatched pair is (x_k, y_{k-1}) and slot
0's (x_0, y_{B-1}): TRL's rotation of the completions within a batch. Fixed batches fix the
mismatched pairs, so their reference log-probs are computed once with the matched ones
(`algorithms/reference.py`, cached in OUTPUT_DIR/ref_logps.pt); TRL fixes them the same way, and
does not shuffle at all (its train_sampling_strategy='sequential').

A step: (1) the policy's log-probs of this rank's mismatched pairs, without gradients; their
log-ratios summed over the ranks give z over the whole batch; (2) forward/backward of this rank's
examples in micro-batches, each loss divided by the whole batch's size. So micro-batches and ranks
add up to the whole batch's update (tested: 2 ranks = 1 rank).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from preftune.algorithms.reference import cached_reference
from preftune.config import Config
from preftune.data.pipeline import load_labeled
from preftune.data.stream import IndexStream
from preftune.data.tensors import read_once
from preftune.data.tokenize import PromptTruncation
from preftune.data.turns import encode_set
from preftune.distributed.group import Parallel
from preftune.errors import UserError
from preftune.losses.kto import kto_loss, kto_reference_point, weight_advice
from preftune.model.load import to_device
from preftune.model.logps import list_logps, microbatches
from preftune.distributed import fsdp
from preftune.algorithms.router import Routers, reduce_metrics

log = logging.getLogger("preftune")


@dataclass
class KTOExample:
    prompt: list[int]
    completion: list[int]
    desirable: bool
    # per completion token, 0 at a tool's output (None: every token counts)
    mask: list[int] | None = None


def encode_labeled(examples, tokenizer, cfg: Config) -> tuple[list[KTOExample], dict]:
    """Prompt and response form one sequence; over kto.max_length, the response is cut (prompt
    kept). A multi-turn response counts its assistant turns only (`data/turns.py`)."""
    examples = list(examples)
    kept, counts = encode_set(
        tokenizer, ((e.prompt, [e.completion], e.tools) for e in examples),
        truncation=PromptTruncation(cfg.data.max_prompt_length, cfg.data.prompt_truncation),
        max_length=cfg.kto.max_length, tools_file=cfg.data.tools, model=cfg.model.name_or_path)
    out = [KTOExample(prompt, c.completion, examples[i].desirable, c.mask)
           for i, prompt, (c,) in kept]
    desirable = sum(e.desirable for e in out)
    return out, {"examples": len(out), "desirable": desirable, "undesirable": len(out) - desirable,
                 **counts}


def fixed_batches(n: int, batch_size: int, seed: int, shuffle: bool) -> list[tuple[int, int]]:
    """Slots (example, its mismatched partner), batch after batch: slots [b B, (b + 1) B) are batch
    b."""
    n_batches = -(-n // batch_size)
    # the filler comes from the next order
    order = IndexStream(n, seed, shuffle).take(n_batches * batch_size)
    slots = []
    for b in range(n_batches):
        batch = order[b * batch_size:(b + 1) * batch_size]
        # k = 0 takes the batch's last completion
        slots += [(e, batch[k - 1]) for k, e in enumerate(batch)]
    return slots


def summed_logps(model, rows: list[tuple], pad_id: int, device) -> torch.Tensor:
    """Summed completion log-probs (n,) of (prompt, completion) or (prompt, completion, mask) token
    lists: one pass of the packer (consecutive rows with one prompt share it, `model/logps.py`);
    masked tokens (a tool's output) are not in the sums."""
    logps, _, _ = list_logps(model, [r[0] for r in rows], [r[1] for r in rows], pad_id, device,
                             masks=[r[2] if len(r) > 2 else None for r in rows])  # (n, T)
    return logps.sum(-1)


class KTOTask:
    """Builds everything; the loop writes `data_report` once setup has succeeded."""

    engine = agent = None  # evaluation samples with the own sampler, through grpo.tools if any

    def __init__(self, cfg: Config, model, tokenizer, device: torch.device, dp: Parallel):
        self.cfg, self.k, self.device, self.dp = cfg, cfg.kto, device, dp
        self.with_kl = self.k.loss_type == "kto"  # apo_zero_unpaired has no reference point
        if self.with_kl and self.k.batch_size < 2:
            raise UserError("must be >= 2 for loss_type kto: z comes from the batch's other "
                            "completions (TRL: the batch size must be > 1)", where="kto.batch_size")
        examples, report = load_labeled(cfg)
        self.encoded, stats = encode_labeled(examples, tokenizer, cfg)
        self.data_report = report | {"encoded": stats}
        if not self.encoded:
            raise UserError(f"no KTO example to train on: {stats['prompts_dropped']} dropped by "
                            "data.prompt_truncation", where=cfg.data.train)
        advice = weight_advice(stats["desirable"], stats["undesirable"], self.k.desirable_weight,
                               self.k.undesirable_weight)
        if advice:
            log.warning(advice)
        self.pad_id = tokenizer.pad_token_id
        self.slots = fixed_batches(len(self.encoded), self.k.batch_size, cfg.seed, cfg.data.shuffle)
        self.routers = Routers.of(model, cfg.model.router_aux_loss_coef)
        self.stream = IndexStream(len(self.slots) // self.k.batch_size, cfg.seed, cfg.data.shuffle)
        # (n_slots, 2) [matched, mismatched], or (n_slots, 1): from a checkpoint, else prepare()
        self.ref = None

    def rows(self, slots: list[int],
             mismatched: bool = False) -> list[tuple[list[int], list[int], list[int] | None]]:
        """(prompt, completion, mask) of each slot, or of its mismatched pair (the partner's
        completion, cut to fit kto.max_length beside this prompt)."""
        out = []
        for s in slots:
            e, partner = (self.encoded[i] for i in self.slots[s])
            if not mismatched:
                out.append((e.prompt, e.completion, e.mask))
                continue
            room = self.k.max_length - len(e.prompt)
            out.append((e.prompt, partner.completion[:room],
                        None if partner.mask is None else partner.mask[:room]))
        return out

    def evaluator(self) -> None:
        """The run's held-out prompts."""

    def prepare(self, model) -> None:
        """The reference log-probs, with `model` still holding the initial (reference) weights,
        unless the restored checkpoint brought them."""
        if self.ref is not None:
            return

        def slot_logps(slots: list[int]) -> torch.Tensor:
            if not self.with_kl:
                # (b, 1)
                return summed_logps(model, self.rows(slots), self.pad_id, self.device)[:, None]
            pairs = [r for s in zip(self.rows(slots), self.rows(slots, mismatched=True)) for r in s]
            # (b, 2): one prompt each
            return summed_logps(model, pairs, self.pad_id, self.device).view(-1, 2)

        every = list(range(len(self.slots)))

        # (prompt, completion, mismatched completion) of every slot, masks where there are any
        def key_rows():
            kl = (
                self.rows(every, mismatched=True)
                if self.with_kl
                else [(None, None, None)] * len(every)
            )
            return ((p, c, k) + (() if m is None and km is None else (m, km))
                    for (p, c, m), (_, k, km) in zip(self.rows(every), kl))

        # each rank its share of the slots, on gathered parameters
        with fsdp.whole(model):
            self.ref = cached_reference(model, every, slot_logps, self.cfg,
                                        key_rows=key_rows, micro_batch_size=self.k.micro_batch_size,
                                        what="KTO examples",
                                        width=2 if self.with_kl else 1, dp=self.dp)

    @torch.no_grad()
    def reference_point(self, model, mine: list[int], B: int, stop) -> torch.Tensor | None:
        """z over the whole batch: this rank's mismatched log-ratios, summed over the ranks."""
        if not self.with_kl:
            return None
        total = torch.zeros((), dtype=torch.float64)
        for sl in microbatches(len(mine), self.k.micro_batch_size):
            stop.check()
            # (b,)
            lp = summed_logps(model, self.rows(mine[sl], mismatched=True), self.pad_id, self.device)
            total += (lp.double().cpu() - self.ref[mine[sl], 1].double()).sum()
        return kto_reference_point(torch.tensor(self.dp.sum(total.item())[0]), B)

    def step(self, model, step: int, stop) -> dict:
        B = self.k.batch_size
        first = self.stream.take(1)[0] * B
        # the global batch's slots; this rank trains on its share
        batch = list(range(first, first + B))
        desirable = sum(self.encoded[self.slots[s][0]].desirable for s in batch)
        mine = batch[self.dp.even_share(B, "kto.batch_size")]
        z = self.reference_point(model, mine, B, stop)
        kw = dict(beta=self.k.beta, desirable_weight=self.k.desirable_weight,
                  undesirable_weight=self.k.undesirable_weight, loss_type=self.k.loss_type)
        parts, counts = [], (desirable, B - desirable)
        for sl in microbatches(len(mine), self.k.micro_batch_size):
            stop.check()
            part = mine[sl]
            lp = summed_logps(model, self.rows(part), self.pad_id, self.device)  # (b,)
            ref = to_device(self.ref[part, 0], lp.device)  # (b,)
            labels = torch.tensor([self.encoded[self.slots[s][0]].desirable for s in part],
                                  device=lp.device)
            loss, m = kto_loss(lp, ref, labels, None, None, kl=z, normaliser=B,
                               counts=counts, sync_metrics=False, **kw)
            if self.routers is not None:
                loss = self.routers.added(loss, len(part) / B)
            loss.backward()  # each part's summed losses over the whole batch's B: the parts add up
            # z is the same for every part: shares that add up to it
            m["kl"] = m["kl"] * (len(part) / B)
            parts.append(m | {"loss": loss.detach()})
        read = read_once(parts)  # one host read for the step
        totals = {k: sum(r[k] for r in read) for k in read[0]}
        rows = self.rows(mine) + (self.rows(mine, mismatched=True) if self.with_kl else [])
        totals["num_tokens"] = sum(len(p) + len(c) for p, c, _ in rows)
        return reduce_metrics(self.dp, totals, self.routers)

    def state_dict(self) -> dict:
        # the reference log-probs too: a resume on a fresh node then needs no reference pass
        return {"stream": self.stream.state_dict(), "ref": self.ref}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
        if state.get("ref") is not None and len(state["ref"]) == len(self.slots):
            self.ref = state["ref"]
