"""A lean batched sampler with a KV cache.

`generate()` spends most of a small model's step in per-token Python machinery (logits processors,
stopping criteria, cache bookkeeping). This loop does only what GRPO needs: prefill each distinct
prompt once, copy its cache G times into preallocated buffers, then one forward per new token with
the last-token logits, a Gumbel-max draw, and one host sync per token (stop when all rows are
done; rows that finished leave the batch once they are an eighth of it).
Positions come from the attention mask, so a left-padded prompt sees the same positions as an
unpadded one, here and in the training forward pass (`model/logps.py` calls
`data/tensors.positions_from_mask`).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from preftune.data.tensors import left_pad, positions_from_mask
from preftune.distributed.fsdp import whole
from preftune.model.head import filter_logits
from preftune.model.core import CausalLM
from preftune.model.load import autocast, base_module, cache_kwarg, device_of
from preftune.model.qwen3_moe import RouteCapture


@dataclass(slots=True)
class Rollout:
    """Everything downstream of the sampler takes a Rollout. N = prompts * G, group-contiguous."""

    prompt_ids: torch.Tensor  # (N, P) left-padded
    prompt_mask: torch.Tensor  # (N, P)
    completion_ids: torch.Tensor  # (N, T) right-padded with pad_id
    completion_mask: torch.Tensor  # (N, T) 1 up to and including EOS
    truncated: torch.Tensor  # (N,) bool: no EOS within max_new_tokens
    old_logps: torch.Tensor | None = None  # (N, T) recorded by the batch's first step when reused
    # (N, T) each token's log-prob under the distribution that drew it
    sampling_logps: torch.Tensor | None = None
    # (N, T) 1 sampled, 0 a tool's result (`rollout/agent.py`); None: all 1
    tool_mask: torch.Tensor | None = None
    # (N, P+T, S, k) int16: a mixture of experts' chosen experts per [prompt | completion] token
    # and routed layer, -1 where none (padding, the last token); the own sampler's, else None
    routes: torch.Tensor | None = None

    def loss_mask(self) -> torch.Tensor:
        """(N, T) the completion tokens the policy sampled: the completion mask without tool
        tokens."""
        return (
            self.completion_mask
            if self.tool_mask is None
            else self.completion_mask * self.tool_mask
        )

    def to(self, device) -> "Rollout":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Rollout(*(move(getattr(self, k)) for k in self.__slots__))


@torch.no_grad()
def sample(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    num_generations: int,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    with_logps: bool = False,
    prefixes: PrefixCache | None = None,
) -> Rollout:
    """Sample `num_generations` completions for each of B prompts -> Rollout with N = B * G rows;
    `with_logps` records each token's behaviour log-prob (`draw`) as `sampling_logps`. With
    `prefixes` (the own module), a prompt that extends a row of the previous call continues
    from its keys/values, and this call's rows are kept for the next (`PrefixCache`)."""
    was_training = model.training
    model.eval()  # dropout off, and HF keeps the cache on even with gradient checkpointing
    try:  # FSDP2: one all-gather per rollout, the decode step reads whole parameters
        with whole(model), autocast(model):
            return _sample(model, prompt_ids, prompt_mask, num_generations,
                           max_new_tokens, eos_id, pad_id,
                           temperature, top_p, top_k, greedy, generator, with_logps, prefixes)
    finally:
        model.train(was_training)


def _sample(model, prompt_ids, prompt_mask, G, max_new_tokens, eos_id, pad_id,
            temperature, top_p, top_k, greedy, generator, with_logps=False,
            prefixes=None) -> Rollout:
    device = device_of(model)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    # (N,) prompt of each row
    copies = torch.arange(prompt_ids.size(0), device=device).repeat_interleave(G)
    decoder = _decoder(model, max_new_tokens, prefixes)
    # inference mode skips autograd's per-op bookkeeping (version counters, view tracking; measured
    # in bench/bench_passes.py). Not where hooks (FSDP2's, the HF module's) may keep tensors made
    # here for the training pass: those stay in `sample`'s no_grad (`inference_mode(False)` would
    # turn grad back on)
    with torch.inference_mode() if decoder.inference else contextlib.nullcontext():
        # (N, V) and (N, P) the prompt's cache columns (P: the prompt's width, or cached + new)
        logits, prompt_cols = decoder.prefill(prompt_ids, prompt_mask, copies)
        N, P = prompt_cols.shape
        # (N, P+T) filled as we go
        attn = torch.zeros(N, P + max_new_tokens, dtype=prompt_mask.dtype, device=device)
        attn[:, :P] = prompt_cols
        next_pos = attn.sum(-1, keepdim=True)  # (N, 1)
        tokens = torch.full((N, max_new_tokens), pad_id, dtype=torch.long, device=device)  # (N, T)
        logps = torch.zeros(N, max_new_tokens, device=device) if with_logps else None  # (N, T)
        rows = torch.arange(N, device=device)  # (n,) the rollout row of each row still in the batch
        done = torch.zeros(N, dtype=torch.bool, device=device)  # (n,)
        for t in range(max_new_tokens):
            drawn = draw(logits, temperature, top_k, top_p, greedy, generator,
                         with_logp=logps is not None)
            tok, lp = drawn if logps is not None else (drawn, None)  # (n,), (n,)
            tok = tok.masked_fill(done, pad_id)
            tokens[rows, t] = tok
            if logps is not None:
                logps[rows, t] = lp.masked_fill(done, 0.0)
            attn[:, P + t] = (~done).to(attn.dtype)  # a finished row's pad is not attended to
            done = done | (tok == eos_id)
            if t == max_new_tokens - 1:
                break
            finished = int(done.sum())  # the one host sync per token: stop, or drop finished rows
            if finished == done.numel():
                break
            if finished * 8 >= done.numel():  # finished rows leave the batch (and the cache)
                keep = (~done).nonzero().squeeze(1)  # (n',)
                decoder.keep(rows, attn[:, :P + t], tokens, keep)
                rows, done, tok, attn, next_pos = (
                    rows[keep],
                    done[keep],
                    tok[keep],
                    attn[keep],
                    next_pos[keep],
                )
            logits = decoder.step(tok, attn[:, :P + t + 1], next_pos, rows)  # (n, V)
            next_pos = next_pos + 1
        decoder.keep(rows, attn[:, :decoder.filled], tokens, None)
    # a normal tensor again
    out = assemble(prompt_ids[copies], prompt_mask[copies], tokens.clone(), eos_id)
    if logps is not None:
        out.sampling_logps = logps[:, :out.completion_ids.size(1)].clone()
    out.routes = decoder.routes(prompt_ids.size(1), out.completion_ids.size(1))
    return out


def _decoder(model, max_new_tokens: int, prefixes: PrefixCache | None):
    """preftune's own model decodes with its `step` (and keeps caches across turns); any other
    module with its forward and a cache."""
    base = base_module(model)
    if isinstance(base, CausalLM):
        return _OwnDecoder(base, max_new_tokens, prefixes)
    return _HFDecoder(model, max_new_tokens)


class _HFDecoder:
    """The module's own forward with a cache whose layers are preallocated buffers."""

    inference = False  # hooks (LoRA, FSDP2) may keep tensors made here

    def __init__(self, model, max_new_tokens: int):
        from transformers import DynamicCache

        self.model, self.new, self.cache, self.kw = (
            model,
            max_new_tokens,
            DynamicCache(),
            cache_kwarg(model),
        )
        self.filled = 0

    def prefill(self, prompt_ids, prompt_mask, copies) -> tuple[torch.Tensor, torch.Tensor]:
        """Each distinct prompt once, its keys/values copied to its G rows -> last-position logits
        (N, V) and the prompt's columns (N, P)."""
        pos = positions_from_mask(prompt_mask)
        out = self.model(input_ids=prompt_ids, attention_mask=prompt_mask,
                         position_ids=pos, use_cache=True,
                         logits_to_keep=1, **{self.kw: self.cache})
        capacity = prompt_ids.size(1) + self.new - 1
        self.cache.layers = [preallocated_layer()(layer.keys[copies],
                                                  layer.values[copies], capacity)
                             for layer in self.cache.layers]
        self.filled = prompt_ids.size(1)
        return out.logits[:, -1].float()[copies], prompt_mask[copies]

    def keep(self, rows, cols, tokens, keep: torch.Tensor | None) -> None:
        if keep is not None:
            self.cache.batch_select_indices(keep)

    def routes(self, P: int, T: int) -> None:
        return None  # the Hugging Face module's routers are not read

    def step(self, tok, attn, pos, rows=None) -> torch.Tensor:
        out = self.model(input_ids=tok[:, None], attention_mask=attn,
                         position_ids=pos, use_cache=True, **{self.kw: self.cache})
        self.filled += 1
        return out.logits[:, -1].float()  # (n, V)


class PrefixCache:
    """The keys/values of one call's rows, kept for the next call of a multi-turn rollout
    (`SamplerEngine.conversation`): a later turn's prompt is an earlier row's tokens + its new
    ones (its stop token, the tool turn), so only the new ones are prefilled. Keyed by token ids,
    as vLLM's prefix cache is: the tool loop needs to say nothing about which row is which."""

    def __init__(self):
        self.rows: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.reused = 0  # prompt tokens not prefilled again, over the conversation

    def longest(self, ids: list[int]) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """The longest kept row that `ids` extends by at least one token -> (its length, keys,
        values (layers, kv_heads, c, d)); (0, None, None) when none."""
        for c in sorted({len(k) for k in self.rows}, reverse=True):
            hit = self.rows.get(tuple(ids[:c])) if c < len(ids) else None
            if hit is not None:
                return c, *hit
        return 0, None, None


class _OwnDecoder:
    """Prefill by the model's forward, then `CausalLM.step` on weights fused once for the rollout, a
    rotary table built once, keys/values written in place into buffers of the final length."""

    def __init__(self, model: CausalLM, max_new_tokens: int, prefixes: PrefixCache | None):
        self.inference = not hasattr(model, "unshard")  # an FSDP2 module's hooks run in the prefill
        device = device_of(model)
        on = torch.is_autocast_enabled(device.type)
        self.dtype = (
            torch.get_autocast_dtype(device.type) if on else model.model.embed_tokens.weight.dtype
        )
        self.model, self.new, self.prefixes, self.filled = model, max_new_tokens, prefixes, 0
        self.weights = model.decoding(self.dtype)
        # a mixture of experts' routes, outside a conversation (a kept prefix's are not kept)
        capture = RouteCapture(model) if prefixes is None else None
        self.capture = capture if capture is not None and capture.layers else None
        self.prefilled: list[torch.Tensor] = []  # (B L, S, k): the prefill's routes
        self.decoded: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step (rows, (n, S, k))

    def prefill(self, prompt_ids, prompt_mask, copies) -> tuple[torch.Tensor, torch.Tensor]:
        """Each distinct prompt once -> last-position logits (N, V) and the prompt's cache columns
        (N, C + L): C columns of kept keys/values (left-padded), then L of new tokens."""
        prompts = [r[m.bool()].tolist() for r, m in zip(prompt_ids, prompt_mask)]
        kept = [self.prefixes.longest(p) if self.prefixes is not None else (0, None, None)
                for p in prompts]
        if self.prefixes is not None:  # this call's rows replace the last call's
            self.prefixes.rows = {}
            self.prefixes.reused += sum(c for c, _, _ in kept)
        lengths = torch.tensor([c for c, _, _ in kept], device=prompt_ids.device)  # (B,)
        new_ids, new_mask = left_pad([p[c:] for p, (c, _, _) in zip(prompts, kept)], 0)  # (B, L)
        new_ids, new_mask = new_ids.to(prompt_ids.device), new_mask.to(prompt_ids.device)
        (B, L), C = new_ids.shape, int(lengths.max())
        old = torch.arange(C, device=lengths.device)[None] >= C - lengths[:, None]  # (B, C)
        cols = torch.cat([old, new_mask.bool()], 1)  # (B, C + L)
        kv = self.model.new_kv(B, C + L, self.dtype)
        for i, (c, keys, values) in enumerate(kept):
            if c:
                kv.keys[:, i, :, C - c:C], kv.values[:, i, :, C - c:C] = keys, values
        pos = lengths[:, None] + positions_from_mask(new_mask)  # (B, L)
        causal = torch.ones(L, C + L, dtype=torch.bool, device=pos.device).tril(C)  # (L, C + L)
        # a left-padding query sees only itself (never an empty softmax row); real tokens never see
        # padding
        itself = torch.zeros(L, C + L, dtype=torch.bool, device=pos.device)
        itself[:, C:] = torch.eye(L, dtype=torch.bool, device=pos.device)
        mask = (causal & cols[:, None, None, :]) | itself  # (B, 1, L, C + L)
        with self.capture.call(self.prefilled) if self.capture else contextlib.nullcontext():
            h = self.model(new_ids, pos, mask, kv=kv, start=C)  # (B, L, H)
        self.copies, self.new_mask = copies, new_mask
        self.kv = self.model.new_kv(copies.numel(), C + L + self.new - 1, self.dtype)
        self.kv.keys[:, :, :, :C + L], self.kv.values[:, :, :, :C + L] = (
            kv.keys[:, copies], kv.values[:, copies])
        self.filled, self.prompts = C + L, [prompts[i] for i in copies.tolist()]
        rot = torch.arange(C + L + self.new, device=pos.device)[None]
        cos, sin = self.model.rope(rot)  # (1, cap, 1, d): the table, built once
        self.cos, self.sin = cos[0, :, 0], sin[0, :, 0]  # (cap, d)
        return self.model.logits(h[:, -1]).float()[copies], cols[copies].long()

    def keep(self, rows, cols, tokens, keep: torch.Tensor | None) -> None:
        """Rows leave the batch (all but `keep`; all when None): their cached keys/values are kept
        for the next turn first. rows (n,) their rollout rows; cols (n, filled) their valid cache
        columns; tokens (N, T) every row's sampled tokens."""
        if self.prefixes is not None:
            gone = torch.ones(rows.numel(), dtype=torch.bool, device=rows.device)
            if keep is not None:
                gone[keep] = False
            for j in gone.nonzero().squeeze(1).tolist():
                valid = cols[j].bool()  # (filled,)
                r = int(rows[j])
                fed = int(valid.sum()) - len(self.prompts[r])
                ids = tuple(self.prompts[r] + tokens[r, :fed].tolist())
                # (layers, nkv, c, d)
                k, v = (b[:, j, :, :self.filled][:, :, valid] for b in (self.kv.keys,
                                                                         self.kv.values))
                self.prefixes.rows.setdefault(ids, (k, v))
        if keep is not None:
            self.kv.select(keep, self.filled)

    def step(self, tok, attn, pos, rows) -> torch.Tensor:
        """The new token of each row still in the batch (`rows`, its rollout rows) -> (n, V)."""
        at = pos[:, 0]  # (n,)
        out: list[torch.Tensor] = []
        with self.capture.call(out) if self.capture else contextlib.nullcontext():
            logits = self.model.step(tok, self.cos[at], self.sin[at], attn.bool(), self.kv,
                                     self.filled, self.weights)
        if out:
            self.decoded.append((rows, out[0]))
        self.filled += 1
        return logits.float()  # (n, V)

    def routes(self, P: int, T: int) -> torch.Tensor | None:
        """The rollout's routes (N, P+T, S, k) (`Rollout.routes`): the prefill's for the prompt
        (left-padded to P), decode step t's for completion token t (the token it fed)."""
        if not self.prefilled:
            return None
        B, L = self.new_mask.shape
        new = self.prefilled[0].view(B, L, *self.prefilled[0].shape[1:])  # (B, L, S, k)
        new = new.masked_fill(~self.new_mask.bool()[:, :, None, None], -1)
        N = self.copies.numel()
        out = new.new_full((N, P + T, *new.shape[2:]), -1)  # (N, P+T, S, k)
        out[:, P - L:P] = new[self.copies]
        for t, (rows, r) in enumerate(self.decoded[:T]):
            out[rows, P + t] = r
        return out


def draw(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, greedy: bool,
         generator: torch.Generator | None, with_logp: bool = False):
    """One token per row (n, V) -> (n,): argmax, or a sample by the Gumbel-max trick
    (argmax of logits/T + Gumbel noise, noise = -log E with E = -log U ~ Exp(1), U uniform), which
    needs no softmax, cumulative sum or multinomial. `with_logp`: also the token's log-prob under
    the distribution drawn from (softmax of the filtered logits/T; 0 for greedy) -> (tok, logp)."""
    if greedy:
        tok = logits.argmax(-1)
        return (tok, torch.zeros(tok.shape, device=tok.device)) if with_logp else tok
    scores = filter_logits(logits / temperature, top_k, top_p)  # (n, V)
    # uniform then two logs: faster on CPU than exponential_ at a large vocabulary
    # (bench/bench_draw.py); U >= tiny keeps the noise finite (float32 rand returns 0 about once in
    # 2^24 draws) (n, V)
    u = torch.rand(scores.shape, generator=generator, device=scores.device, dtype=scores.dtype)
    # (n, V): log E = -Gumbel
    noise = u.clamp_min_(torch.finfo(scores.dtype).tiny).log_().neg_().log_()
    tok = (scores - noise).argmax(-1)  # (n,)
    if not with_logp:
        return tok
    return tok, scores.gather(-1, tok[:, None]).squeeze(1) - scores.logsumexp(-1)  # (n,), (n,)


@functools.cache
def preallocated_layer():
    """The class of a KV-cache layer whose keys/values live in buffers of the final length: a decode
    step writes its column in place (a DynamicLayer concatenates, copying the whole cache per
    token). Built on first use, so importing this module does not import transformers."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
            super().__init__()
            b, h, n, d = keys.shape
            self.kbuf = keys.new_empty(b, h, max(capacity, n), d)  # (N, H, cap, D)
            self.vbuf = values.new_empty(b, h, max(capacity, n), values.size(-1))
            self.kbuf[:, :, :n], self.vbuf[:, :, :n] = keys, values
            self.device, self.is_initialized = keys.device, True
            self._view(n)

        def update(self, key_states, value_states, *args, **kwargs):
            n, q = self.length, key_states.shape[-2]
            self.kbuf[:, :, n:n + q] = key_states
            self.vbuf[:, :, n:n + q] = value_states
            self._view(n + q)
            return self.keys, self.values

        def batch_select_indices(self, indices):
            self.kbuf, self.vbuf = _select(self.kbuf, indices,
                                           self.length), _select(self.vbuf, indices, self.length)
            self._view(self.length)

        def _view(self, n):
            self.length = n
            self.keys, self.values = self.kbuf[:, :, :n], self.vbuf[:, :, :n]  # (n, H, L, D) views

    return PreallocatedLayer


def _select(buf: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """The rows of a cache buffer, copying only the n filled columns."""
    out = buf.new_empty(rows.numel(), *buf.shape[1:])
    out[:, :, :n] = buf[rows, :, :n]
    return out


def assemble(prompt_ids, prompt_mask, tokens, eos_id) -> Rollout:
    is_eos = tokens == eos_id  # (N, T)
    has_eos = is_eos.any(-1)  # (N,)
    no_eos = torch.full_like(has_eos, tokens.size(1), dtype=torch.long)  # (N,)
    first_eos = torch.where(has_eos, is_eos.float().argmax(-1), no_eos)
    idx = torch.arange(tokens.size(1), device=tokens.device)[None]  # (1, T)
    completion_mask = (idx <= first_eos[:, None]).long()  # (N, T) includes the EOS token
    length = int(completion_mask.sum(-1).max().item()) if tokens.numel() else 0
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                   completion_ids=tokens[:, :max(length, 1)],
                   completion_mask=completion_mask[:, :max(length, 1)], truncated=~has_eos)


def select(ro: Rollout, rows: torch.Tensor | list[int]) -> Rollout:
    rows = torch.as_tensor(rows, dtype=torch.long, device=ro.completion_ids.device)
    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    return Rollout(prompt_ids=ro.prompt_ids[rows], prompt_mask=ro.prompt_mask[rows],
                   completion_ids=ro.completion_ids[rows], completion_mask=ro.completion_mask[rows],
                   truncated=ro.truncated[rows], old_logps=pick(ro.old_logps),
                   sampling_logps=pick(ro.sampling_logps), tool_mask=pick(ro.tool_mask),
                   routes=pick(ro.routes))


def concat(rollouts: list[Rollout], pad_id: int) -> Rollout:
    """Stack rollouts of different widths: prompts stay left-padded, completions right-padded."""
    if len(rollouts) == 1:
        return rollouts[0]
    P = max(r.prompt_ids.size(1) for r in rollouts)
    T = max(r.completion_ids.size(1) for r in rollouts)

    def lpad(t, width, value):
        return torch.nn.functional.pad(t, (width - t.size(1), 0), value=value)

    def rpad(t, width, value):
        return torch.nn.functional.pad(t, (0, width - t.size(1)), value=value)

    has_old = all(r.old_logps is not None for r in rollouts)
    has_sampling = all(r.sampling_logps is not None for r in rollouts)
    # a round without tool rows: all sampled
    has_tools = any(r.tool_mask is not None for r in rollouts)
    return Rollout(
        prompt_ids=torch.cat([lpad(r.prompt_ids, P, pad_id) for r in rollouts]),
        prompt_mask=torch.cat([lpad(r.prompt_mask, P, 0) for r in rollouts]),
        completion_ids=torch.cat([rpad(r.completion_ids, T, pad_id) for r in rollouts]),
        completion_mask=torch.cat([rpad(r.completion_mask, T, 0) for r in rollouts]),
        truncated=torch.cat([r.truncated for r in rollouts]),
        old_logps=torch.cat([rpad(r.old_logps, T, 0.0) for r in rollouts]) if has_old else None,
        sampling_logps=torch.cat([rpad(r.sampling_logps, T, 0.0) for r in rollouts])
        if has_sampling
        else None,
        tool_mask=torch.cat([rpad(r.loss_mask(), T, 0) for r in rollouts]) if has_tools else None,
        routes=_concat_routes(rollouts, P, T),
    )


def _concat_routes(rollouts: list[Rollout], P: int, T: int) -> torch.Tensor | None:
    """The rollouts' routes, their prompts' left-padded to P and completions' right-padded to T."""
    # a round with no rows (a rank without prompts) has none to give
    if any(r.routes is None and r.completion_ids.size(0) for r in rollouts) \
            or all(r.routes is None for r in rollouts):
        return None
    parts = []
    for r in (r for r in rollouts if r.routes is not None):
        p, t = r.prompt_ids.size(1), r.completion_ids.size(1)
        part = r.routes.new_full((r.routes.size(0), P + T, *r.routes.shape[2:]), -1)
        part[:, P - p:P], part[:, P:P + t] = r.routes[:, :p], r.routes[:, p:]
        parts.append(part)
    return torch.cat(parts)
