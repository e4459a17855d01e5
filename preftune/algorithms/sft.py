"""The SFT task: completion-only negative log-likelihood on (prompt, completion) examples.

Examples come from labeled traces (rejection sampling: reward >= sft.min_reward), TRL's
prompt/completion columns or its conversational `messages` (`data/sft.py`). A micro-batch is laid
out either padded (one example per row, `train/logps.completion_logps`) or packed: several examples
concatenated in a row of at most `sft.max_length` tokens, position ids restarting at 0 for each
example and no attention mask, from which transformers builds a block-diagonal causal mask (and
flash-attention its varlen boundaries), so no token attends across examples. Both layouts give the
same loss (tested); packing is used when it cuts the positions the decoder runs over by 10% or more.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from preftune.config import Config
from preftune.data.pipeline import load_examples
from preftune.data.stream import IndexStream
from preftune.data.tensors import left_pad, right_pad
from preftune.data.tokenize import PromptTruncation, encode_prompt, encode_response, fit_prompt
from preftune.data.traces import TraceOptions
from preftune.distributed import Parallel
from preftune.errors import UserError
from preftune.losses.sft import sft_loss
from preftune.model.head import token_logps
from preftune.model.load import autocast, to_device
from preftune.model.logps import Rows, completion_logps, microbatches


@dataclass
class EncodedExample:
    prompt: list[int]
    completion: list[int]

    def __len__(self) -> int:
        return len(self.prompt) + len(self.completion)


def encode_examples(examples, tokenizer, cfg: Config) -> tuple[list[EncodedExample], dict]:
    """Prompt under data.max_prompt_length's policy; the completion (+ EOS) cut to fit sft.max_length."""
    trunc = PromptTruncation(cfg.data.max_prompt_length, cfg.data.prompt_truncation)
    out, cut = [], 0
    for i, e in enumerate(examples):
        prompt = fit_prompt(trunc, encode_prompt(tokenizer, e.prompt), cfg.sft.max_length, where=f"example {i}")
        if prompt is None:
            continue
        room = cfg.sft.max_length - len(prompt)
        completion = encode_response(tokenizer, e.completion)
        cut += len(completion) > room
        out.append(EncodedExample(prompt, completion[:room]))
    return out, {"examples": len(out), "prompts_truncated": trunc.truncated, "prompts_dropped": trunc.dropped,
                 "completions_truncated": cut}


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Example indices per row, first fit in the given order (deterministic); each row holds at most
    `capacity` tokens and every example fits in one row (lengths <= capacity)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        j = next((r for r, free in enumerate(room) if free >= n), None)
        if j is None:
            rows.append([]), room.append(capacity)
            j = len(rows) - 1
        rows[j].append(i)
        room[j] -= n
    return rows


def packed_batch(batch: list[EncodedExample], rows: list[list[int]], pad_id: int):
    """ids (R, L), position ids (R, L) restarting per example (padding forms its own run), and for every
    completion token in example order its row, the position that predicts it, and its id (N,) each."""
    width = max(sum(len(batch[i]) for i in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (R, L)
    pos = torch.zeros((len(rows), width), dtype=torch.long)  # (R, L)
    where: dict[int, tuple[int, int]] = {}
    for r, row in enumerate(rows):
        off = 0
        for i in row:
            e = batch[i]
            ids[r, off:off + len(e)] = torch.tensor(e.prompt + e.completion)
            pos[r, off:off + len(e)] = torch.arange(len(e))
            where[i] = (r, off)
            off += len(e)
        pos[r, off:] = torch.arange(width - off)
    row_idx, col_idx, targets = [], [], []
    for i, e in enumerate(batch):
        r, off = where[i]
        start = off + len(e.prompt) - 1  # the position that predicts the first completion token
        row_idx += [r] * len(e.completion)
        col_idx += range(start, start + len(e.completion))
        targets += e.completion
    return ids, pos, torch.tensor(row_idx), torch.tensor(col_idx), torch.tensor(targets)


def packed_logps(model, batch: list[EncodedExample], rows: list[list[int]], pad_id: int, device):
    """Completion-token log-probs and entropies, flat (N,) in example order, from packed rows."""
    ids, pos, r, c, targets = packed_batch(batch, rows, pad_id)  # on the host
    keep = torch.unique(c)  # positions some completion token is predicted from (sorted; on the host: no device sync)
    ids, pos, r, c, targets, keep = (to_device(t, device) for t in (ids, pos, r, c, targets, keep))
    with autocast(model):  # attention_mask=None + restarting positions: attention stays within each example
        out = model(input_ids=ids, position_ids=pos, logits_to_keep=keep, use_cache=False)
    logits = out.logits.float()[r, torch.searchsorted(keep, c)]  # (N, V)
    return token_logps(logits, targets, with_entropy=True)


def padded_logps(model, batch: list[EncodedExample], pad_id: int, device):
    """The same (N,) log-probs and entropies with one example per row (left-padded prompts)."""
    p_ids, p_mask = left_pad([e.prompt for e in batch], pad_id)  # (b, P)
    c_ids, c_mask = right_pad([e.completion for e in batch], pad_id)  # (b, T)
    p_ids, p_mask, c_ids, c_mask = (to_device(t, device) for t in (p_ids, p_mask, c_ids, c_mask))
    rows = Rows.of([e.prompt for e in batch], [len(e.completion) for e in batch])  # sizes the pass: no host read
    logps, entropy = completion_logps(model, p_ids, p_mask, c_ids, c_mask, with_entropy=True, rows=rows)  # (b, T)
    real = c_mask.bool()
    return logps[real], entropy[real]  # row-major: example order


def choose_rows(batch: list[EncodedExample], capacity: int, packing: str) -> list[list[int]] | None:
    """Rows to pack into, or None for the padded layout. packing: auto | always | never; auto packs
    when rows x width is at most 90% of examples x longest example (decoder positions)."""
    if packing == "never":
        return None
    lengths = [len(e) for e in batch]
    rows = pack_rows(lengths, capacity)
    packed = len(rows) * max(sum(lengths[i] for i in row) for row in rows)
    if packing == "always" or packed <= 0.9 * len(batch) * max(lengths):
        return rows
    return None


class SFTTask:
    """Builds everything and writes nothing: the loop writes `data_report` once setup has succeeded."""

    def __init__(self, cfg: Config, model, tokenizer, device: torch.device, dp=None):
        self.cfg, self.s, self.device, self.dp = cfg, cfg.sft, device, dp or Parallel()
        self.packing = "auto" if self.s.packing else "never"
        examples, report = load_examples(cfg.data.train, TraceOptions.from_config(cfg.data), self.s.min_reward,
                                         split=cfg.eval.split)
        self.encoded, stats = encode_examples(examples, tokenizer, cfg)
        self.data_report = report | {"encoded": stats}
        if not self.encoded:
            raise UserError("no SFT example left after tokenisation (prompts dropped by data.prompt_truncation: "
                            f"{stats['prompts_dropped']})", where=cfg.data.train)
        self.pad_id = tokenizer.pad_token_id
        self.stream = IndexStream(len(self.encoded), cfg.seed, cfg.data.shuffle)

    def logps(self, model, batch: list[EncodedExample]):
        rows = choose_rows(batch, self.s.max_length, self.packing)
        if rows is None:
            return padded_logps(model, batch, self.pad_id, self.device)
        return packed_logps(model, batch, rows, self.pad_id, self.device)

    def step(self, model, step: int, stop) -> dict:
        batch = [self.encoded[i] for i in self.stream.take(self.s.batch_size)]  # the global batch
        B, n_items = len(batch), sum(len(e.completion) for e in batch)  # n_items: the whole step's loss normaliser
        mine = batch[self.dp.split(B, "sft.batch_size")]  # this rank's share (all of it in one process)
        loss_sum = entropy_sum = 0.0
        for sl in microbatches(len(mine), self.s.micro_batch_size):
            stop.check()
            logps, entropy = self.logps(model, mine[sl])  # (n,), (n,)
            loss = sft_loss(logps, torch.ones_like(logps), n_items)
            loss.backward()  # normalised by the step's token count: micro-batches and ranks add up exactly
            loss_sum += loss.item()
            entropy_sum += entropy.sum().item()
        # partial sums of this rank's share, added up over the ranks
        return self.dp.reduce_metrics({"loss": loss_sum, "entropy": entropy_sum / n_items,
                                       "completion_length": sum(len(e.completion) for e in mine) / B,
                                       "num_tokens": sum(len(e) for e in mine)})

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
