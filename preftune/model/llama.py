"""A lean forward pass of Llama-family decoders (Llama, Qwen2, Qwen3, Mistral) on the weights of the
Hugging Face module, where the module's own forward costs more than its maths:

- decoding (`rollout/sampler.py`): one token per row per step, where per-call work (mask building,
  cache objects, one matmul per projection, a dozen small tensor ops per layer) is most of a small
  model's step. Here q/k/v and gate/up are one matmul each, the rotary table is built once per
  rollout, keys/values are written in place into buffers of the final length, and `Lean.step`
  runs a token in fewer tensor ops than `forward` (279 against 347 for a 4-layer model, views included);
- tree-packed sequences (`train/dpo.py`): a DPO pair as one sequence [prompt | chosen | rejected]
  whose rejected tokens attend to the prompt and to themselves, never to the chosen ones, with
  several pairs packed into a row. The prompt runs once and no padding is computed, which a
  module that builds its own causal mask cannot express;
- the training passes (GRPO's per-row log-probs, `train/logps.py`; DPO's packed rows): RMSNorm
  and RoPE with hand-written backward passes (fewer passes over the activations than autograd's)
  and no concatenated weights, whose gradients would be one more copy.

The maths is the module's (RMSNorm in float32, rotate-half RoPE from the model's own rotary
module, SDPA attention), tested equal to it in float64 and under bf16 autocast. Anything else
(LoRA, FSDP/DDP wrappers, activation checkpointing, sliding windows, dynamic RoPE, other
architectures) takes the Hugging Face forward: `Lean.of(model)` returns None for it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")  # model_type values whose layers this replays
# q/k/v and gate/up are fused into one matrix each for decoding only: there the copy serves a whole
# rollout of small matmuls. Any other pass builds its `Lean` per micro-batch, and the copy cost more than
# the fused products saved (bench/bench_passes.py, a no-grad pass of the 3M model: 100 ms fused, 93 ms
# separate over 32 x 84 tokens; 15 and 9 ms over 8 x 28); with grad the fused product's gradient
# would also be assembled by one more copy.


def _base(model):
    """The decoder stack (`model.model`) of a Llama-family `*ForCausalLM` from transformers itself
    (not remote code reusing a model_type with its own forward), or None."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return None
    if getattr(getattr(model, "config", None), "model_type", None) not in ARCHITECTURES:
        return None
    return inner if type(model).__module__.startswith("transformers.models.") else None


def stack_and_head(model):
    """(decoder stack, output layer) of a plain or LoRA-wrapped Llama-family causal LM, or None:
    where `train/logps.py` may project hidden states itself. Not under FSDP2/DDP (the root module's
    forward must run) nor with `model.lean_forward: false`."""
    if getattr(model, "preftune_one_forward", False) or not getattr(model, "preftune_lean", True):
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    stack = _base(base)
    return None if stack is None else (stack, base.lm_head)


def supported(model) -> bool:
    """Can `Lean` replay this model exactly? A plain HF module (float32/64 or bf16 weights, or float32
    masters under preftune's bf16 autocast, which the caller enters as for the module), no wrappers."""
    if hasattr(model, "peft_config") or stack_and_head(model) is None:
        return False  # LoRA, FSDP2/DDP, model.lean_forward: false, other architectures, remote code
    cfg, base = model.config, _base(model)
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return False
    if getattr(base, "gradient_checkpointing", False) or getattr(base, "is_activation_checkpointing", False):
        return False
    if getattr(cfg, "use_sliding_window", False):
        return False
    if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None):
        return False
    # dynamic and longrope frequencies depend on the longest position of each call; the sampler
    # builds its rotary table once for the whole rollout
    rope_type = getattr(base.rotary_emb, "rope_type", "default")
    if "dynamic" in rope_type or "longrope" in rope_type or getattr(cfg, "attention_dropout", 0.0):
        return False
    params = list(model.parameters())  # plain tensors (not DTensor shards), any floating dtype
    return bool(params) and all(type(p) is torch.nn.Parameter and p.is_floating_point() for p in params)


class KVBuffers:
    """Keys and values of every layer in buffers of the final length: (layers, N, kv_heads, cap, d)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    def select(self, rows: torch.Tensor, filled: int) -> None:
        """Keep these rows (finished ones leave the batch), copying only the filled columns."""
        for name in ("keys", "values"):
            buf = getattr(self, name)
            out = buf.new_empty(buf.size(0), rows.numel(), *buf.shape[2:])
            out[:, :, :, :filled] = buf[:, rows, :, :filled]
            setattr(self, name, out)


class Lean:
    """The decoder as a few tensor ops on the module's parameters. Built per use (a rollout, a
    micro-batch): it reads the live parameters, so gradients flow back into them and an optimiser
    step is seen by the next `Lean.of`. q/k/v and gate/up are fused into one matrix each for
    `decoding` only. With grad, RMSNorm and RoPE have hand-written backward passes (`_RMSNorm`,
    `_Rope`: fewer passes over the activations than autograd's)."""

    def __init__(self, model, decoding: bool = False):
        cfg, base = model.config, _base(model)
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.embed, self.norm, self.head = base.embed_tokens.weight, base.norm.weight, model.lm_head.weight
        self.head_module = model.lm_head  # for `train/head.py`'s chunked projection
        self.rotary = base.rotary_emb
        self.layers = [self._fuse(layer, decoding) for layer in base.layers[: cfg.num_hidden_layers]]
        device = self.embed.device.type
        if decoding and not torch.is_grad_enabled() and torch.is_autocast_enabled(device):
            # decoding under bf16 autocast: cast the fused matrices once, not on every step (autocast
            # caches casts of leaf parameters only; these are concatenations)
            low = torch.get_autocast_dtype(device)
            cast = lambda t: None if t is None else t.to(low)  # noqa: E731
            self.head = cast(self.head)
            for w in self.layers:
                for k in ("qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias", "down", "down_bias"):
                    w[k] = cast(w[k])

    @classmethod
    def of(cls, model, decoding: bool = False) -> "Lean | None":
        return cls(model, decoding) if supported(model) else None

    @staticmethod
    def _fuse(layer, fuse: bool) -> dict:
        """The layer's weights; with `fuse`, q/k/v and gate/up each one matrix, else tuples of parts
        (see `_project`)."""
        a, mlp = layer.self_attn, layer.mlp

        def join(mods):
            weights, biases = [m.weight for m in mods], [m.bias for m in mods]
            if all(b is None for b in biases):
                biases = None
            elif fuse:
                biases = [w.new_zeros(w.size(0)) if b is None else b for w, b in zip(weights, biases)]
            if not fuse:
                return tuple(weights), biases
            # stored transposed, (in, out) in memory, as the matmul reads it: 10-20% faster small products
            return torch.cat(weights).t().contiguous().t(), biases and torch.cat(biases)

        qkv, qkv_bias = join((a.q_proj, a.k_proj, a.v_proj))
        gate_up, gate_up_bias = join((mlp.gate_proj, mlp.up_proj))
        return {
            "norm1": layer.input_layernorm.weight, "norm2": layer.post_attention_layernorm.weight,
            "qkv": qkv, "qkv_bias": qkv_bias, "o": a.o_proj.weight, "o_bias": a.o_proj.bias,
            "gate_up": gate_up, "gate_up_bias": gate_up_bias, "down": mlp.down_proj.weight,
            "down_bias": mlp.down_proj.bias,
            "q_norm": getattr(getattr(a, "q_norm", None), "weight", None),
            "k_norm": getattr(getattr(a, "k_norm", None), "weight", None),
        }

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm as the HF module computes it: in float32 (even for float64 weights), then the weight."""
        if x.dtype == torch.float32 and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _RMSNorm.apply(x, weight, self.eps)  # the same forward, a shorter backward
        h = x.to(torch.float32)  # a no-op for float32
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, L, d) for position ids (B, L), from the model's own rotary module."""
        return self.rotary(self.embed[:1], positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and vocabulary projection of chosen positions: (..., H) -> (..., V)."""
        return F.linear(self.rms(hidden, self.norm), self.head)

    def forward(self, ids: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None, *,
                kv: KVBuffers | None = None, start: int | torch.Tensor = 0) -> torch.Tensor:
        """Hidden states before the final norm (B, L, H) for token ids (B, L).

        mask: boolean (B, 1, L, S), True where a query may attend a key, or None for plain causal
        attention over the L tokens. With `kv`, the new keys/values are written at columns
        start..start+L-1 and attention runs over columns 0..start+L-1 (S = start + L). With `start`
        a (1,) tensor (one token per row), they are written at that column and attention runs over
        every column of the buffers (S = capacity, the mask says which count): the same shapes and
        addresses on every step, which a CUDA graph needs (`rollout/sampler.py`)."""
        B, L = ids.shape
        fixed = isinstance(start, torch.Tensor)
        if mask is None and kv is not None and not fixed and start:  # causal over the cache: query i sees 0..start+i
            mask = torch.ones(L, start + L, dtype=torch.bool, device=ids.device).tril(diagonal=start)[None, None]
        if mask is not None and L > 1:  # SDPA turns a boolean mask into an additive one: once, not per layer
            mask = torch.zeros(mask.shape, dtype=self.embed.dtype, device=ids.device).masked_fill_(
                ~mask, float("-inf"))  # (B or 1, 1, L, S)
        cos, sin = (t.unsqueeze(2) for t in rope)  # (B, L, 1, d)
        x = F.embedding(ids, self.embed)  # (B, L, H)
        for i, w in enumerate(self.layers):
            q, k, v = self._qkv(self.rms(x, w["norm1"]), w, cos, sin)  # (B, nh | nkv, L, d)
            if fixed:
                kv.keys[i].index_copy_(2, start, k.to(kv.keys.dtype))  # (B, nkv, 1, d) into column `start`
                kv.values[i].index_copy_(2, start, v.to(kv.values.dtype))  # (casts as the slice assignment does)
                k, v = kv.keys[i], kv.values[i]  # (B, nkv, capacity, d)
            elif kv is not None:
                kv.keys[i, :, :, start:start + L] = k  # (B, nkv, L, d) into columns start..start+L-1
                kv.values[i, :, :, start:start + L] = v
                k, v = kv.keys[i, :, :, :start + L], kv.values[i, :, :, :start + L]  # (B, nkv, S, d)
            o = _attend(q, k, v, mask)  # (B, L, nh d)
            x = x + F.linear(o, w["o"], w["o_bias"])
            inner = w["down"].size(1)
            gate, up = _project(self.rms(x, w["norm2"]), w["gate_up"], w["gate_up_bias"], (inner, inner))  # (B, L, I)
            x = x + F.linear(F.silu(gate) * up, w["down"], w["down_bias"])  # (B, L, H)
        return x

    def _qkv(self, h: torch.Tensor, w: dict, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated q (B, nh, L, d), rotated k and v (B, nkv, L, d) of normed hidden states (B, L, H)."""
        B, L, _ = h.shape
        d, nh, nkv = self.head_dim, self.heads, self.kv_heads
        if isinstance(w["qkv"], torch.Tensor) and w["q_norm"] is None:  # fused: q and k in one rotation
            qk, v = F.linear(h, w["qkv"], w["qkv_bias"]).view(B, L, nh + 2 * nkv, d).split((nh + nkv, nkv), 2)
            q, k = _rotate(qk, cos, sin).split((nh, nkv), 2)  # (B, L, nh | nkv, d)
        else:
            parts = _project(h, w["qkv"], w["qkv_bias"], (nh * d, nkv * d, nkv * d))
            q, k, v = (t.view(B, L, -1, d) for t in parts)  # (B, L, nh | nkv | nkv, d)
            if w["q_norm"] is not None:  # Qwen3 normalises each head's q and k before the rotation
                q, k = self.rms(q, w["q_norm"]), self.rms(k, w["k_norm"])
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)  # (B, L, nh | nkv, d)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def quick(self) -> bool:
        """Can `step` decode here? Fused weights without autocast (whose casts `step`'s fused
        residual adds would skip) and without Qwen3's per-head q/k norms."""
        return (isinstance(self.layers[0]["qkv"], torch.Tensor) and self.layers[0]["q_norm"] is None
                and not torch.is_autocast_enabled(self.embed.device.type))

    def step(self, tok: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
             kv: KVBuffers, col: int | torch.Tensor) -> torch.Tensor:
        """One new token per row -> logits (n, V): `forward` for decoding in a quarter fewer tensor
        ops, since on a CPU a small model's decode step costs per op more than per FLOP.

        tok (n,); cos, sin (n, d), the new positions' rotary rows; mask (n, S) boolean, the cache
        columns a row attends (the new one included). The keys/values go to column `col`: an int
        attends columns 0..col (S = col + 1); a (1,) tensor, the whole buffers (S = capacity) at
        fixed shapes, as `forward` does.
        Residual adds run inside the o and down matmuls (addmm), RoPE's cross terms are two fused
        multiply-adds (`_rotate_into`), and attention scores are one baddbmm with an additive mask
        built once per step."""
        n, d, nh, nkv = tok.size(0), self.head_dim, self.heads, self.kv_heads
        g, S = nh // nkv, mask.size(1)
        if not isinstance(col, torch.Tensor) and S != col + 1:  # wider would read unwritten columns
            raise ValueError(f"Lean.step: the mask covers {S} columns, the cache {col + 1}")
        cos, sin = cos[:, None], sin[:, None]  # (n, 1, d)
        bias = torch.zeros(mask.shape, dtype=self.embed.dtype, device=tok.device).masked_fill_(
            ~mask, float("-inf"))  # (n, S)
        bias = bias[:, None, None].expand(n, nkv, 1, S).reshape(n * nkv, 1, S)  # each key head's rows
        wide = torch.promote_types(self.embed.dtype, torch.float32)  # softmax at least in float32
        x = F.embedding(tok, self.embed)  # (n, H)
        for i, w in enumerate(self.layers):
            qkv = _addmm(w["qkv_bias"], self.rms(x, w["norm1"]), w["qkv"])  # (n, (nh + 2 nkv) d)
            qk = qkv[:, :(nh + nkv) * d].view(n, nh + nkv, d)
            qk = _rotate_into(qk * cos, qk, sin)  # (n, nh + nkv, d) rotated
            k, v = qk[:, nh:], qkv[:, (nh + nkv) * d:].view(n, nkv, d)  # (n, nkv, d)
            if isinstance(col, torch.Tensor):
                kv.keys[i].index_copy_(2, col, k[:, :, None])  # (n, nkv, 1, d) into column `col`
                kv.values[i].index_copy_(2, col, v[:, :, None])
            else:
                kv.keys[i, :, :, col], kv.values[i, :, :, col] = k, v
            keys = kv.keys[i, :, :, :S].reshape(n * nkv, S, d)  # a view: rows and heads merge
            values = kv.values[i, :, :, :S].reshape(n * nkv, S, d)  # (n nkv, S, d)
            q = qk[:, :nh].reshape(n * nkv, g, d)  # the g query heads of each key head
            scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=d ** -0.5)  # (n nkv, g, S)
            probs = scores.to(wide).softmax(-1).to(values.dtype)  # (n nkv, g, S)
            o = torch.bmm(probs, values).view(n, nh * d)  # (n, nh d)
            x = _addmm(x, o, w["o"], w["o_bias"])  # x + o Wo^T (+ b)
            gate, up = _addmm(w["gate_up_bias"], self.rms(x, w["norm2"]), w["gate_up"]).chunk(2, -1)  # (n, I)
            x = _addmm(x, F.silu(gate) * up, w["down"], w["down_bias"])  # (n, H)
        return self.logits(x)  # (n, V)

    def new_kv(self, rows: int, capacity: int) -> KVBuffers:
        """Buffers in the dtype keys/values are computed in: the autocast dtype when it is on."""
        shape = (len(self.layers), rows, self.kv_heads, capacity, self.head_dim)
        device = self.embed.device
        on = torch.is_autocast_enabled(device.type)
        dtype = torch.get_autocast_dtype(device.type) if on else self.embed.dtype
        return KVBuffers(self.embed.new_empty(shape, dtype=dtype), self.embed.new_empty(shape, dtype=dtype))


def _addmm(base: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """base + x @ weight.T (+ bias) for 2-D x (n, in): one matmul that adds (base None: x @ weight.T)."""
    out = torch.mm(x, weight.t()) if base is None else torch.addmm(base, x, weight.t())
    return out if bias is None else out + bias


def _project(x: torch.Tensor, weight, bias, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """The outputs (..., size) of x @ weight.T + bias for one fused matrix (split into `sizes`, views
    of one product) or for a tuple of matrices (with a list of biases or None): never a
    concatenation, whose backward would copy every gradient once more."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias).split(sizes, -1)
    biases = [None] * len(weight) if bias is None else bias
    return tuple(F.linear(x, w, b) for w, b in zip(weight, biases))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x * cos + [-x2, x1] * sin. (B, L, h, d) -> (B, L, h, d)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rope.apply(x, cos, sin)
    if x.dtype in (torch.float32, torch.float64):  # as `_Rope` computes it, without building [-x2, x1]
        return _rotate_into(x * cos, x, sin)
    # bf16/fp16: the module's own ops and roundings, so a frozen bf16 reference gives the module's
    # log-probs (a fused multiply-add rounds once where the module rounds twice)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _rotate_into(y: torch.Tensor, x: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """y += [-x2 s1, x1 s2], in place on y's halves (..., d): the rotation's cross terms in two
    fused multiply-adds, without building [-x2, x1]."""
    h = x.size(-1) // 2
    x1, x2, s1, s2 = x[..., :h], x[..., h:], sin[..., :h], sin[..., h:]
    y[..., :h].addcmul_(x2, s1, value=-1.0)
    y[..., h:].addcmul_(x1, s2)
    return y


class _Rope(torch.autograd.Function):
    """RoPE for the training passes, in three passes over x each way instead of about six:
    y = x c + [-x2 s1, x1 s2]; dx = g c + [g2 s2, -g1 s1] (the rotation's transpose)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate_into(x * cos, x, sin)  # (B, L, h, d)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        h = g.size(-1) // 2
        gx = g * cos  # (B, L, h, d)
        gx[..., :h].addcmul_(g[..., h:], sin[..., h:])  # + g2 s2
        gx[..., h:].addcmul_(g[..., :h], sin[..., :h], value=-1.0)  # - g1 s1
        return gx, None, None


class _RMSNorm(torch.autograd.Function):
    """RMSNorm (Zhang & Sennrich, 2019) for the training passes: y = w n, n = x r,
    r = 1 / sqrt(mean(x^2) + eps); forward as the HF module computes it, backward
    dx = r (g w - n mean(g w n)), dw = sum over tokens of g n, in about 8 passes over x instead
    of autograd's 12, keeping x and r (not n)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x * rstd)

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        n = x * rstd  # (..., H)
        gn = g * weight
        gx = torch.addcmul(gn, n, (gn * n).mean(-1, keepdim=True), value=-1.0).mul_(rstd)
        gw = (g * n).flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None  # (H,)
        return gx, gw, None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention with grouped keys/values -> (B, L, nh d). q (B, nh, L, d), k/v (B, nkv, S, d).
    One query per row (decoding) is two small matmuls; SDPA's kernel costs more than its maths there."""
    B, nh, L, d = q.shape
    nkv = k.size(1)
    if L > 1 or q.requires_grad:
        if nkv != nh and mask is not None and q.device.type == "cuda":
            # CUDA's flash kernel takes no mask and the efficient one no grouped heads: repeat k/v so
            # a masked call does not fall back to the math kernel (which keeps the B x h x L x S weights)
            k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))  # (B, nh, S, d)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=k.size(1) != nh)  # (B, nh, L, d)
        return o.transpose(1, 2).reshape(B, L, nh * d)
    qg = q.view(B, nkv, nh // nkv, d)  # (B, nkv, g, d): the g query heads that share a key head
    scores = torch.matmul(qg, k.transpose(-1, -2)) * d ** -0.5  # (B, nkv, g, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # mask (B, 1, 1, S)
    wide = torch.promote_types(scores.dtype, torch.float32)  # bf16 scores: softmax in float32 as SDPA's kernels do
    probs = scores.to(wide).softmax(-1).to(v.dtype)  # (B, nkv, g, S)
    return torch.matmul(probs, v).reshape(B, L, nh * d)


def tree_mask(segment: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """Attention mask of tree-packed rows -> (B, 1, L, L) boolean.

    segment (B, L): which sequence of the row a token belongs to (-1: padding);
    branch (B, L): 0 for the shared trunk (the prompt), k > 0 for the k-th continuation.
    A token attends an earlier (or the same) token of its sequence on the trunk or on its own
    branch. Padding attends only itself, so no row of the softmax is empty."""
    L = segment.size(1)
    causal = torch.ones(L, L, dtype=torch.bool, device=segment.device).tril()  # (L, L)
    same = segment[:, :, None] == segment[:, None, :]  # (B, L, L) query x key
    visible = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])
    pad = segment < 0  # (B, L)
    mask = same & visible & causal & ~pad[:, None, :]
    mask |= torch.eye(L, dtype=torch.bool, device=segment.device) & pad[:, :, None]
    return mask[:, None]  # (B, 1, L, L)
