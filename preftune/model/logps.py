"""Per-token log-probabilities of completion tokens under a causal LM (shared by GRPO and DPO)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from preftune.data.tensors import positions_from_mask
from preftune.model.head import head_logps, token_logps, upcast_logits
from preftune.model.llama import Lean, stack_and_head as split_head
from preftune.model.load import autocast, cache_kwarg, to_device


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
        """One host read. Rows share a prompt when their real tokens and padding agree (padding ids may differ)."""
        if prompt_ids.size(0) == 0:  # a rank can hold no rows of a batch
            return cls([], [], [])
        same = ((prompt_ids[1:] == prompt_ids[:-1]) | (prompt_mask[1:] == 0)).all(1) \
            & (prompt_mask[1:] == prompt_mask[:-1]).all(1)  # (B-1,) row i+1 repeats row i
        starts = torch.cat([same.new_ones(1), ~same]).long()  # (B,) 1 where a run begins
        p, c, g = torch.stack([prompt_mask.sum(1).long(), completion_mask.sum(1).long(), starts.cumsum(0)]).tolist()
        return cls(p, c, g)

    @classmethod
    def of(cls, prompts: list[list[int]], completion_lengths: list[int]) -> "Rows":
        """From the rows' prompt tokens and completion lengths, already on the host."""
        starts = [int(i == 0 or prompts[i] != prompts[i - 1]) for i in range(len(prompts))]
        return cls([len(x) for x in prompts], list(completion_lengths), list(itertools.accumulate(starts)))

    def __getitem__(self, rows: slice | list[int]) -> "Rows":
        pick = (lambda xs: xs[rows]) if isinstance(rows, slice) else (lambda xs: [xs[i] for i in rows])  # noqa: E731
        return Rows(pick(self.prompt), pick(self.completion), pick(self.group))

    def groups(self) -> list[int] | None:
        """Sizes of the runs of rows with the same prompt, or None when no row repeats the one before."""
        sizes = [len(list(run)) for _, run in itertools.groupby(self.group)]
        return None if len(sizes) == len(self.group) else sizes

    @property
    def width(self) -> int:
        """The longest row's real tokens (prompt + completion), at least 1."""
        return max(1, max((p + c for p, c in zip(self.prompt, self.completion)), default=0))


def completion_logps(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    rows: Rows | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(y_t | x, y_<t) for each completion token -> (B, T) and optionally the entropy (B, T).

    Equivalent layouts, the cheapest by a multiply-add count from the model config: shared (rows
    with the same prompt next to each other, as GRPO groups and DPO pairs are: each distinct prompt
    runs once, its keys/values are copied to its rows and the completions run on them; the copy's
    backward sums the rows' gradients into the one prompt pass), else one pass per row: on the lean
    decoder over left-packed rows (`_lean_hidden`) where it replays the model, otherwise on the
    module, aligned (left-padded prompts, right-padded completions) or packed (each row's
    prompt+completion moved left, which pays when prompt lengths vary a lot). Only positions that
    predict completion tokens are projected to the vocabulary; logits are divided by the sampling
    temperature (the ratio is taken against the distribution the completions were drawn from, as
    TRL does); log-softmax is logit - logsumexp, so no (B, T, V) log-softmax is kept for the
    backward. `rows` (these rows' `Rows`) saves the one host read that sizes the pass.
    """
    split = split_head(model)
    feats = completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, split=split, rows=rows)
    if split is not None:  # (B, T, H) hidden states: the projection, chunked for large vocabularies
        with autocast(model):
            return head_logps(feats, split[1], completion_ids, temperature=temperature, with_entropy=with_entropy)
    logits = feats  # (B, T, V)
    if temperature != 1.0:
        logits = logits / temperature
    return token_logps(logits, completion_ids, with_entropy=with_entropy)



def completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *, split=None,
                      rows: Rows | None = None) -> torch.Tensor:
    """Float logits that predict each completion token -> (B, T, V), in the cheapest layout; with
    `split` (`split_head`), the decoder's hidden states at those positions (B, T, H) instead."""
    if rows is None:
        rows = Rows.read(prompt_ids, prompt_mask, completion_mask)
    if min(rows.prompt) < 1:
        raise ValueError("every prompt needs at least one token")
    groups = rows.groups()
    if groups is not None and shared_pays(model, rows, prompt_mask.size(1), completion_ids.size(1), len(groups)):
        return _shared_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, groups, split, rows)
    if split is not None:
        lean = Lean.of(model)
        if lean is not None:
            with autocast(model):
                return _lean_hidden(lean, prompt_ids, prompt_mask, completion_ids, completion_mask, rows)
    ids, attn, keep, idx = _layout(model, prompt_ids, prompt_mask, completion_ids, completion_mask, rows)
    with autocast(model):
        mask = _hf_mask(model, attn, attn.size(1), left_padded=idx is None and min(rows.prompt) < prompt_mask.size(1))
        # no mask: HF reads the positions once to look for packed sequences (a host read per pass,
        # kept: a 4-D mask would cost the attention its causal fast path)
        logits = _run(model, split, keep, input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(attn),
                      use_cache=False)  # (B, keep, V or H)
    if idx is None:  # aligned: position P-1+t predicts completion token t
        return logits[:, :-1]  # (B, T, V)
    # packed: completion token t of row b is predicted at idx[b, t]
    return logits.gather(1, idx[..., None].expand(-1, -1, logits.size(-1)))  # (B, T, V)


def _lean_hidden(lean, prompt_ids, prompt_mask, completion_ids, completion_mask, rows: Rows) -> torch.Tensor:
    """Final-normed hidden states (B, T, H) that predict each completion token, by the lean decoder over the
    packed layout: each row's tokens moved left, so padding only follows real tokens and plain
    causal attention (no mask) is exact for them."""
    ids, _, start = pack_left(prompt_ids, prompt_mask, completion_ids, completion_mask, rows.width)  # (B, L), (B,)
    L, T = ids.size(1), completion_ids.size(1)
    hidden = lean.forward(ids, lean.rope(torch.arange(L, device=ids.device)[None]), None)  # (B, L, H)
    idx = (start[:, None] - 1 + torch.arange(T, device=ids.device)).clamp(max=L - 1)  # (B, T) predicting positions
    return lean.rms(hidden.gather(1, idx[..., None].expand(-1, -1, hidden.size(-1))), lean.norm)  # (B, T, H)


def _hf_mask(model, keys: torch.Tensor, queries: int, left_padded: bool) -> torch.Tensor | None:
    """The attention mask for the HF module, built without reading `keys` (B, S) on the host (HF
    reads a 2-D mask to decide whether it can skip it: a device sync per call). No padding before
    a real token (`left_padded` False, known from `Rows`): None, plain causal attention, exact for
    every real token. Else, with SDPA and full attention in every layer, the 4-D boolean mask
    (B, 1, queries, S) HF builds (query i, at column S - queries + i, sees the real keys up to its
    column; here also itself, so no softmax row is empty), which HF takes as it is. Other
    attention kernels, and sliding-window layers (HF would hand them this mask unchanged), get
    the 2-D mask."""
    if not left_padded:
        return None
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not _full_attention(config):
        return keys
    S = keys.size(1)
    col = torch.arange(S, device=keys.device)  # (S,)
    at = col[S - queries:, None]  # (queries, 1) each query's column
    return (((col <= at) & keys.bool()[:, None, :]) | (col == at))[:, None]  # (B, 1, queries, S)


def _full_attention(config) -> bool:
    """Does every layer attend over the whole causal past (no sliding window, no chunks)?"""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    return not getattr(config, "sliding_window", None)


def _run(model, split, keep: int, **kwargs) -> torch.Tensor:
    """The model's last `keep` positions: upcast logits, or hidden states from the decoder stack."""
    if split is None:
        return upcast_logits(model(logits_to_keep=keep, **kwargs).logits)  # (B, keep, V)
    return split[0](**kwargs).last_hidden_state[:, -keep:]  # (B, keep, H)



def _uses_cache(model) -> bool:
    """Activation checkpointing makes HF drop the cache in training: then nothing can be shared."""
    if getattr(model, "preftune_one_forward", False):  # FSDP2: every pass must issue the same collectives
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    flag = getattr(base, "is_activation_checkpointing", None)
    if flag is None:
        flag = getattr(base, "is_gradient_checkpointing", False)
    return not (flag and model.training) and hasattr(base, "config")


def shared_pays(model, rows: Rows, prompt_width: int, T: int, n_prompts: int) -> bool:
    """Is one prompt pass per group plus a completion pass cheaper than the best per-row layout?
    prompt_width, T: the padded prompt and completion widths."""
    if not _uses_cache(model) or min(rows.prompt) < 1:  # an empty prompt: the per-row layouts say so
        return False
    B, P = len(rows.prompt), max(rows.prompt)
    body, head = unit_costs(getattr(model, "config", None))
    if not (body and head):
        return n_prompts < B
    shared = (n_prompts * P + B * (T - 1)) * body + (n_prompts + B * (T - 1)) * head
    unshared = min((prompt_width + T) * body, rows.width * body) * B + B * (T + 1) * head
    # two forwards and a cache copy instead of one: take it only when it saves a quarter or more
    return shared < 0.75 * unshared


def _shared_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, sizes: list[int], split,
                   rows: Rows) -> torch.Tensor:
    """Each distinct prompt once (U rows), its cache copied to its rows, then the completions."""
    from transformers import DynamicCache


    B, T = completion_ids.shape
    device = prompt_ids.device
    firsts = to_device([0, *itertools.accumulate(sizes)][:-1], device)  # (U,) first row of each group
    lead = prompt_mask.size(1) - max(rows.prompt)  # all-padding columns on the left: drop them
    p_ids, p_mask = prompt_ids[:, lead:], prompt_mask[:, lead:]  # (B, P')
    group = to_device([u for u, n in enumerate(sizes) for _ in range(n)], device)  # (B,) group of each row
    cache = DynamicCache()
    kw = {cache_kwarg(model): cache}
    u_mask = p_mask[firsts]  # (U, P')
    padded = min(rows.prompt) < p_mask.size(1)  # some prompt is left-padded
    with autocast(model):
        mask = _hf_mask(model, u_mask, u_mask.size(1), padded)
        first = _run(model, split, 1, input_ids=p_ids[firsts], attention_mask=mask,
                     position_ids=positions_from_mask(u_mask), use_cache=True, **kw)[group]  # (B, 1, V or H)
        if T == 1:  # the last prompt position predicts token 0
            return first
        cache.reorder_cache(group)  # index_select: its backward sums the G rows into the prompt pass
        attn = torch.cat([p_mask, completion_mask[:, :-1]], 1)  # (B, P'+T-1)
        pos = p_mask.sum(1, keepdim=True) + torch.arange(T - 1, device=p_mask.device)  # (B, T-1)
        rest = _run(model, split, T - 1, input_ids=completion_ids[:, :-1], position_ids=pos, use_cache=True,
                    attention_mask=_hf_mask(model, attn, T - 1, padded), **kw)  # (B, T-1, V or H)
    return torch.cat([first, rest], 1)  # (B, T, V or H)


def _layout(model, prompt_ids, prompt_mask, completion_ids, completion_mask, rows: Rows):
    """Choose the cheaper of two equivalent layouts -> (ids, mask, logits_to_keep, gather index or None).

    aligned: [left-padded prompt | right-padded completion], width P+T, logits for the last T+1.
    packed:  each row's prompt+completion moved left, width = longest real row, but logits from the
             earliest completion start, so uneven prompts widen the vocabulary projection.
    The estimate weighs transformer width against lm_head positions using the model's config."""
    T, P = completion_ids.size(1), prompt_ids.size(1)
    ids, attn, start = pack_left(prompt_ids, prompt_mask, completion_ids, completion_mask, rows.width)  # (B, L)
    first = min(rows.prompt)  # the earliest completion position over the batch
    keep = ids.size(1) - first + 1  # logits for positions first-1 .. L-1
    if not prefer_packed(getattr(model, "config", None), ids.size(1), keep, P, T):
        return torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), T + 1, None
    idx = ((start - first)[:, None] + torch.arange(T, device=ids.device)[None]).clamp(max=keep - 1)  # (B, T)
    return ids, attn, keep, idx


def prefer_packed(config, width: int, keep: int, P: int, T: int) -> bool:
    """Is the packed layout (width, keep) cheaper than the aligned one (P+T, T+1)? Multiply-adds per
    position: the decoder's projections vs the lm_head, from the model config when it has them."""
    body, head = unit_costs(config)
    if not (body and head):
        return keep <= T + 1
    # packing costs a sort and a gather of the logits: take it only when it saves a tenth or more
    return width * body + keep * head < 0.9 * ((P + T) * body + (T + 1) * head)


def unit_costs(config) -> tuple[int, int]:
    """Multiply-adds per position of the decoder body and of the lm_head (0, 0 when unknown)."""
    H, V = getattr(config, "hidden_size", 0), getattr(config, "vocab_size", 0)
    layers, inter = getattr(config, "num_hidden_layers", 0), getattr(config, "intermediate_size", 4 * H)
    return layers * (4 * H * H + 3 * H * inter), H * V


def pack_left(prompt_ids, prompt_mask, completion_ids, completion_mask, width: int):
    """Move each row's real tokens (prompt then completion) to the left, padding to the right.
    Returns ids (B, L), mask (B, L) with L = width (the longest real row, `Rows.width`), and prompt
    lengths (B,)."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P+T)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)  # (B, P+T)
    order = torch.sort((mask == 0).to(torch.int8), dim=1, stable=True).indices  # real first, order kept
    ids, mask = ids.gather(1, order), mask.gather(1, order)
    return ids[:, :width], mask[:, :width], prompt_mask.sum(1)


def microbatches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def length_buckets(lengths: list[int], *, slack: float = 0.25, min_rows: int = 4) -> list[list[int]]:
    """Row indices grouped by length so that padding each group to its longest row computes at most
    `slack` more positions than the rows hold (groups of at least `min_rows`, as each group is one
    more forward). Shortest first; rows keep no particular order inside a group."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    buckets: list[list[int]] = []
    cur: list[int] = []
    real = 0
    for i in order:
        if len(cur) >= min_rows and (len(cur) + 1) * lengths[i] > (1 + slack) * (real + lengths[i]):
            buckets.append(cur)
            cur, real = [], 0
        cur.append(i)
        real += lengths[i]
    return buckets + [cur] if cur else buckets
