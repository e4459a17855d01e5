"""Per-token log-probs of completions under the policy or a reference, for every algorithm.

A batch is rows of (left-padded prompt, right-padded completion); consecutive rows with the same
prompt form a unit (a GRPO group, a DPO pair), whose prompt is a trunk and whose completions are
branches. One packer lays units out as the rows of one forward pass of preftune's own model
(`model/core.py` and its families), and one rule (`_plan`) chooses the layout by a multiply-add
count:

- plain: each completion row its own sequence [prompt | completion], left-aligned, padding after:
  causal attention with no mask (SDPA's flash kernel on CUDA);
- packed: units (each prompt once, its completions as branches that see the prompt and
  themselves) or single rows, several to a row, under a tree mask: no prompt is computed twice
  and little padding is, at the cost of attention over the whole row.

Only positions that predict completion tokens reach the vocabulary projection, inside the model's
forward (chunked, `model/head.py`). The Hugging Face module (other architectures,
`model.lean_forward: false`) runs the plain layout with its own attention mask.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch

from preftune.data.tensors import left_pad, positions_from_mask, right_pad
from preftune.model.head import filter_logits, token_logps, upcast_logits
from preftune.model.load import autocast, base_module, to_device
from preftune.model.core import CausalLM
from preftune.model.ops import tree_mask

MASKED = 1.5  # attention under a mask costs more than the causal kernel (bench/bench_passes.py)


@dataclass(frozen=True)
class Rows:
    """What sizes the log-prob pass of a batch of rows, on the host: real prompt and completion
    tokens per row and a run id per row (consecutive rows with the same prompt share it). Read from
    the device once per batch (`Rows.read`) or built from token lists (`Rows.of`), then sliced per
    micro-batch: no micro-batch waits on a device-to-host read."""

    prompt: list[int]
    completion: list[int]
    group: list[int]

    @classmethod
    def read(cls, prompt_ids, prompt_mask, completion_mask) -> "Rows":
        """One host read. Rows share a prompt when their real tokens and padding agree (padding ids
        may differ)."""
        if prompt_ids.size(0) == 0:  # a rank can hold no rows of a batch
            return cls([], [], [])
        same = ((prompt_ids[1:] == prompt_ids[:-1]) | (prompt_mask[1:] == 0)).all(1) \
            & (prompt_mask[1:] == prompt_mask[:-1]).all(1)  # (B-1,) row i+1 repeats row i
        starts = torch.cat([same.new_ones(1), ~same]).long()  # (B,) 1 where a run begins
        p, c, g = torch.stack([prompt_mask.sum(1).long(), completion_mask.sum(1).long(),
                               starts.cumsum(0)]).tolist()
        return cls(p, c, g)

    @classmethod
    def of(cls, prompts: list[list[int]], completion_lengths: list[int]) -> "Rows":
        """From the rows' prompt tokens and completion lengths, already on the host."""
        starts = [int(i == 0 or prompts[i] != prompts[i - 1]) for i in range(len(prompts))]
        return cls([len(x) for x in prompts], list(completion_lengths),
                   list(itertools.accumulate(starts)))

    def __getitem__(self, rows: slice | list[int]) -> "Rows":
        pick = (
            (lambda xs: xs[rows]) if isinstance(rows, slice) else (lambda xs: [xs[i] for i in rows])
        )  # noqa: E731
        return Rows(pick(self.prompt), pick(self.completion), pick(self.group))

    def units(self) -> list[list[int]]:
        """The rows of each run of equal prompts."""
        return [[i for i, _ in run] for _,
                run in itertools.groupby(enumerate(self.group), key=lambda x: x[1])]

    @property
    def width(self) -> int:
        """The longest row's real tokens (prompt + completion), at least 1."""
        return max(1, max((p + c for p, c in zip(self.prompt, self.completion)), default=0))


def completion_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *,
                     temperature: float = 1.0, with_entropy: bool = False, rows: Rows | None = None,
                     pack: bool = True, top_k: int = 0, top_p: float = 1.0,
                     loss_mask: torch.Tensor | None = None, stats: bool = False,
                     routes: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(y_t | x, y_<t) for each completion token -> (B, T), and optionally the entropy (B, T),
    0 at padding. Logits are divided by the sampling temperature (the ratio is taken against the
    distribution the completions were drawn from, as TRL does). `rows` (these rows' `Rows`)
    saves the one host read that sizes the pass; `pack` False keeps the plain layout.
    `top_k`/`top_p` give the sampler's log-probs instead (softmax over the kept tokens; no gradient,
    no entropy). `stats`: instead of the entropy, `head.token_stats` (B, T, 4), 0 at padding.
    `loss_mask` (B, T): 0 at completion tokens that are not the policy's (a tool's output inside an
    agent response): they stay in the sequence (attended to) but their log-prob and entropy (or
    stats) are 0, with no gradient; None or all ones gives exactly the unmasked result.
    `routes` (B, P+T, S, k): a mixture of experts' experts per [prompt | completion] token and
    routed layer, recorded by the sampler (-1: none), which the routed layers replay or compare
    with (`qwen3_moe.SparseMoE`); the own module only."""
    logps, entropy = _completion_logps(model, prompt_ids, prompt_mask,
                                       completion_ids, completion_mask,
                                       temperature, with_entropy, rows, pack, top_k, top_p, stats,
                                       routes)
    if loss_mask is None:
        return logps, entropy
    keep = loss_mask.to(device=logps.device).bool()  # (B, T)
    if entropy is not None:
        entropy = torch.where(keep.view(*keep.shape, *[1] * (entropy.dim() - 2)), entropy, 0.0)
    return torch.where(keep, logps, 0.0), entropy


def _completion_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                      temperature, with_entropy,
                      rows, pack, top_k, top_p, stats,
                      routes=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if rows is None:
        rows = Rows.read(prompt_ids, prompt_mask, completion_mask)
    if rows.prompt and min(rows.prompt) < 1:
        raise ValueError("every prompt needs at least one token")
    if not isinstance(base_module(model), CausalLM):
        return _module_logps(model, prompt_ids, prompt_mask, completion_ids,
                             completion_mask, temperature, with_entropy, top_k, top_p, stats)
    B, T = completion_ids.shape
    plan = _plan(rows, prompt_ids.size(1), T, base_module(model).config, pack=pack)
    device = completion_ids.device
    table = torch.cat([prompt_ids, completion_ids], 1).reshape(-1)  # (B (P+T),) every row's tokens
    ids = table[to_device(plan.cells, device)].view(plan.rows, plan.width)  # (R, W)
    pos = to_device(plan.positions, device).view(plan.rows, plan.width)  # (R, W)
    mask = None
    if plan.segment is not None:
        mask = tree_mask(
            *(to_device(x, device).view(plan.rows, plan.width) for x in (plan.segment, plan.branch))
        )
    dst = to_device(plan.dst, device)  # (K,) flat (row, t) of each predicted completion token
    if routes is not None:  # each cell's token's routes; padding cells' are never attended to
        cells = to_device(plan.cells, device)
        # (R, W, S, k)
        routes = routes.to(device).flatten(0, 1)[cells].view(plan.rows, plan.width,
                                                              *routes.shape[2:])
    record = base_module(model).router_record  # a mixture of experts' routers, when recorded
    with (
        autocast(model),
        record.pass_(to_device(plan.weights, device)) if record else contextlib.nullcontext(),
    ):
        logps, entropy = model(ids, pos, mask, index=to_device(plan.src, device),
                               targets=completion_ids.reshape(-1)[dst], temperature=temperature,
                               # (K,)
                               with_entropy=with_entropy, top_k=top_k, top_p=top_p, stats=stats,
                               routes=routes)
    out = logps.new_zeros(B * T).index_copy(0, dst, logps).view(B, T)
    ent = (
        None
        if entropy is None
        else entropy.new_zeros(B * T, *entropy.shape[1:])
        .index_copy(0, dst, entropy)
        .view(B, T, *entropy.shape[1:])
    )
    return out, ent


def list_logps(model, prompts: list[list[int]], completions: list[list[int]],
               pad_id: int, device, *,
               with_entropy: bool = False, pack: bool = True,
               masks: list[list[int] | None] | None = None, stats: bool = False):
    """`completion_logps` of rows given as token lists -> log-probs (n, T), entropy (n, T) or None,
    completion mask (n, T): 1 at the tokens that count. Sized from the lists (no host read);
    consecutive rows with one prompt share it (DPO's pairs, KTO's mismatched pairs). `masks`: per
    row its completion's loss mask (`completion_logps`' loss_mask), None for a row whose every
    token counts; the returned mask is the padding mask times it."""
    p_ids, p_mask = left_pad(prompts, pad_id)  # (n, P)
    c_ids, c_mask = right_pad(completions, pad_id)  # (n, T)
    rows = Rows.of(prompts, [len(c) for c in completions])
    p_ids, p_mask, c_ids, c_mask = (to_device(t, device) for t in (p_ids, p_mask, c_ids, c_mask))
    loss_mask = None
    if masks is not None and any(m is not None for m in masks):
        loss_mask, _ = right_pad([[1] * len(c) if m is None else m for m,
                                  c in zip(masks, completions)], 0)
        # (n, T) 0 at padding and at tokens that are not the policy's
        loss_mask = to_device(loss_mask, device)
    logps, entropy = completion_logps(model, p_ids, p_mask, c_ids, c_mask,
                                      with_entropy=with_entropy, rows=rows,
                                      pack=pack, loss_mask=loss_mask, stats=stats)
    return logps, entropy, c_mask if loss_mask is None else c_mask * loss_mask


@dataclass
class Plan:
    """A packed forward pass: per cell (R x W, flat) the token's index into the rows' [prompt |
    completion] table, its position and (under a mask) its sequence and branch; per predicted
    completion token the predicting cell (`src`) and its flat (row, t) in the output (`dst`)."""

    rows: int
    width: int
    cells: list[int]
    positions: list[int]
    segment: list[int] | None
    branch: list[int] | None
    src: list[int]
    dst: list[int]
    weights: list[int]  # per cell the rows it stands for: a trunk's its branches, padding 0


def unit_costs(config) -> tuple[int, int]:
    """Multiply-adds per token of the decoder blocks, and per token pair of attention."""
    H, layers = getattr(config, "hidden_size", 1), getattr(config, "num_hidden_layers", 1)
    # a mixture of experts: the k experts a token runs
    inter = getattr(config, "intermediate_size", 4 * H)
    inter = getattr(config, "moe_intermediate_size", 0) * getattr(config,
                                                                  "num_experts_per_tok", 0) or inter
    return layers * (4 * H * H + 3 * H * inter), layers * 2 * H


def _plan(rows: Rows, P: int, T: int, config, *, pack: bool = True) -> Plan:
    """The cheapest layout: plain rows, or units / single rows packed first-fit into rows 1, 2, 4 or
    8 times the longest sequence wide, by the multiply-adds of the blocks and of attention."""
    body, attn = unit_costs(config)
    B = len(rows.prompt)
    best, choice = B * (rows.width * body + rows.width ** 2 * attn), None  # plain
    options = [[[i] for i in range(B)]] if pack else []  # single rows
    if pack and len(rows.units()) < B:
        options.append(rows.units())  # each prompt once
    for units in options:
        lengths = [rows.prompt[u[0]] + sum(rows.completion[i] for i in u) for u in units]
        for k in (1, 2, 4, 8):
            packed, width = pack_rows(lengths, k * max(lengths, default=1))
            cost = len(packed) * (width * body + MASKED * width ** 2 * attn)
            if cost < best:
                best, choice = cost, (units, packed, width)
    if choice is None:
        return _layout([[[i]] for i in range(B)], rows.width, rows, P, T, masked=False)
    units, packed, width = choice
    return _layout([[units[j] for j in row] for row in packed], width, rows, P, T, masked=True)


def _layout(packed: list[list[list[int]]], width: int, rows: Rows, P: int, T: int,
            *, masked: bool) -> Plan:
    """Cells of `packed` (per row, its units; per unit, its batch rows: the first row's prompt, then
    each row's completion as a branch)."""
    F = P + T  # the table's stride: a batch row's [prompt | completion]
    n = len(packed) * width
    cells, positions = [0] * n, [0] * n
    segment, branch = ([-1] * n, [0] * n) if masked else (None, None)
    src, dst, weights = [], [], [0] * n
    for r, units in enumerate(packed):
        at = r * width
        for s, unit in enumerate(units):
            b0, p = unit[0], rows.prompt[unit[0]]
            cells[at:at + p], positions[at:at + p] = range(b0 * F + P - p, b0 * F + P), range(p)
            weights[at:at + p] = [len(unit)] * p
            if masked:
                segment[at:at + p] = [s] * p
            # the trunk's last cell predicts each branch's first token
            last, start = at + p - 1, at + p
            for k, b in enumerate(unit):
                c = rows.completion[b]
                cells[start : start + c], positions[start : start + c] = (
                    range(b * F + P, b * F + P + c),
                    range(p, p + c),
                )
                weights[start:start + c] = [1] * c
                if masked:
                    segment[start:start + c], branch[start:start + c] = [s] * c, [k + 1] * c
                if c:
                    src += [last, *range(start, start + c - 1)]
                    dst += range(b * T, b * T + c)
                start += c
            at = start
    return Plan(len(packed), width, cells, positions, segment, branch, src, dst, weights)


def pack_rows(lengths: list[int], width: int | None = None) -> tuple[list[list[int]], int]:
    """First-fit decreasing: sequences into rows of `width` (default and at least the longest)
    -> (rows of sequence indices, the widest row's filled length)."""
    width = max([width or 0, *lengths, 1])
    rows, room = [], []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    filled = max((width - free for free in room), default=1)
    return rows, max(filled, 1)


def _module_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                  temperature, with_entropy, top_k=0, top_p=1.0, stats=False):
    """The Hugging Face module's forward over [left-padded prompt | right-padded completion], logits
    for the last T + 1 positions only."""
    T = completion_ids.size(1)
    attn = torch.cat([prompt_mask, completion_mask], 1)  # (B, P+T)
    with autocast(model):
        out = model(input_ids=torch.cat([prompt_ids, completion_ids], 1), attention_mask=attn,
                    position_ids=positions_from_mask(attn), logits_to_keep=T + 1, use_cache=False)
    logits = upcast_logits(out.logits[:, :-1])  # (B, T, V): position P-1+t predicts token t
    if temperature != 1.0:
        logits = logits / temperature
    if top_k or top_p < 1.0:  # the sampler's distribution (`head.filter_logits`); no entropy
        B, T, V = logits.shape
        logits, with_entropy = filter_logits(logits.reshape(B * T, V), top_k,
                                             top_p).view(B, T, V), False
    logps, entropy = token_logps(logits, completion_ids, with_entropy=with_entropy, stats=stats)
    keep = completion_mask.to(logps.dtype)
    if top_k or top_p < 1.0:  # a dropped padding target is -inf, and -inf * 0 is NaN
        return torch.where(keep.bool(), logps, 0.0), None
    return logps * keep, None if entropy is None else entropy * (keep[..., None] if stats else keep)


def microbatches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]
