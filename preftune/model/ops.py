"""The arithmetic every family of the own module shares: RMSNorm (float32, a hand-written
backward), the rotary embeddings (rotate-half over the whole head for the Llama family; adjacent
pairs over the first part of the head for GLM), SDPA attention, the tree mask, residual-adding
matmuls and the decode step's KV buffers. No module structure here: the families build theirs."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms(x, self.weight, self.eps)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the HF module computes it: in float32 (even for float64 weights), then the
    weight."""
    if (
        x.dtype == torch.float32
        and torch.is_grad_enabled()
        and (x.requires_grad or weight.requires_grad)
    ):
        return _RMSNorm.apply(x, weight, eps)  # the same forward, a shorter backward
    h = x.to(torch.float32)  # a no-op for float32
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


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


def addmm(base: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor,
          bias: torch.Tensor | None = None):
    """base + x @ weight.T (+ bias) for 2-D x (n, in): one matmul that adds (base None: x @
    weight.T). A float32 residual over bf16 products (mixed precision) keeps its dtype, as under
    autocast."""
    if base is None or base.dtype != x.dtype:
        out = torch.mm(x, weight.t())
        out = out if bias is None else out + bias
        return out if base is None else base + out.to(base.dtype)
    out = torch.addmm(base, x, weight.t())
    return out if bias is None else out + bias


# ---------------------------------------------------------------- rotary position embeddings

class Rotary(nn.Module):
    """The rotary frequencies of a config: inv_freq (r/2,) over the first r = head_dim x
    `partial_rotary_factor` channels of a head (theta^(-2i/r); scaled types take transformers'
    table for their `rope_type`). `forward` gives cos, sin (B, L, r) as the HF modules do:
    in float32, the frequencies repeated once ([f, f]), times the type's attention scaling."""

    def __init__(self, config):
        super().__init__()
        rope = dict(getattr(config, "rope_parameters", None) or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        head_dim = getattr(config, "head_dim",
                           None) or config.hidden_size // config.num_attention_heads
        if kind == "default":
            dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
            base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            # computed on the CPU, as the HF modules compute it, whatever device the module is
            # built on: on the meta device arange runs torch's Python reference, whose first call
            # imports sympy and dynamo (a second of a restart)
            steps = torch.arange(0, dim, 2, dtype=torch.float, device="cpu")
            inv_freq = (1.0 / (base ** (steps / dim))).to(torch.empty(0).device)
            self.attention_scaling = 1.0
        else:  # yarn, llama3, linear, ...: transformers' published table for that type
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[kind](config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)  # (r/2,) float32

    @torch.no_grad()
    def forward(self, like: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (B, L, r/2)
        freqs = positions[...,
                          None].float() * self.inv_freq.to(device=like.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, L, r)
        return (emb.cos() * self.attention_scaling).to(like.dtype), (
            emb.sin() * self.attention_scaling
        ).to(like.dtype)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head: x * cos + [-x2, x1] * sin. (B, L, h, d) -> (B, L, h,
    d)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rope.apply(x, cos, sin)
    # as `_Rope` computes it, without building [-x2, x1]
    if x.dtype in (torch.float32, torch.float64):
        return rotate_into(x * cos, x, sin)
    # bf16/fp16: the module's own ops and roundings, so a frozen bf16 reference gives the module's
    # log-probs (a fused multiply-add rounds once where the module rounds twice)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rotate_half_step(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The decode step's rotate-half: q (n, h, d), cos/sin (n, 1, d)."""
    return rotate_into(q * cos, q, sin)


def rotate_into(y: torch.Tensor, x: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
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
        return rotate_into(x * cos, x, sin)  # (B, L, h, d)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        h = g.size(-1) // 2
        gx = g * cos  # (B, L, h, d)
        gx[..., :h].addcmul_(g[..., h:], sin[..., h:])  # + g2 s2
        gx[..., h:].addcmul_(g[..., :h], sin[..., :h], value=-1.0)  # - g1 s1
        return gx, None, None


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved partial RoPE (GLM): channel pairs (2i, 2i+1) of the first r channels turn by
    angle i: (a, b) -> (a c_i - b s_i, b c_i + a s_i); channels r.. pass unchanged. x (..., h, d);
    cos/sin (..., 1, r) as `Rotary` gives them ([f, f]: the first r/2 are the pairs' angles).
    Autograd differentiates it (elementwise, on half the head)."""
    r = cos.size(-1)
    c, s = cos[..., : r // 2], sin[..., : r // 2]  # (..., 1, r/2)
    a, b = x[..., :r:2], x[..., 1:r:2]  # (..., h, r/2) even and odd channels
    turned = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)  # (..., h, r)
    return torch.cat((turned, x[..., r:]), dim=-1)  # (..., h, d)


# ---------------------------------------------------------------- attention

def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention with grouped keys/values -> (B, L, nh d). q (B, nh, L, d), k/v (B, nkv, S,
    d); mask additive (B, 1, L, S), or None for causal attention (SDPA's flash kernel on CUDA)."""
    B, nh, L, d = q.shape
    if mask is not None and k.size(1) != nh and q.device.type == "cuda":
        # CUDA's flash kernel takes no mask and the efficient one no grouped heads: repeat k/v so a
        # masked call does not fall back to the math kernel (which keeps the B x h x L x S weights)
        k, v = (t.repeat_interleave(nh // k.size(1), dim=1) for t in (k, v))  # (B, nh, S, d)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and L > 1,
                                       enable_gqa=k.size(1) != nh)  # (B, nh, L, d)
    return o.transpose(1, 2).reshape(B, L, nh * d)


def tree_mask(segment: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """Attention mask of packed rows -> (B, 1, L, L) boolean.

    segment (B, L): which sequence of the row a token belongs to (-1: padding);
    branch (B, L): 0 for the shared trunk (a prompt), k > 0 for the k-th continuation.
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


class KVBuffers:
    """Keys and values of every layer in buffers of the final length: (layers, N, kv_heads, cap,
    d)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    def select(self, rows: torch.Tensor, filled: int) -> None:
        """Keep these rows (finished ones leave the batch), copying only the filled columns."""
        for name in ("keys", "values"):
            buf = getattr(self, name)
            out = buf.new_empty(buf.size(0), rows.numel(), *buf.shape[2:])
            out[:, :, :, :filled] = buf[:, rows, :, :filled]
            setattr(self, name, out)


# ---------------------------------------------------------------- weights for the decode step

def merged(linear, whole=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A projection's weight and bias, a LoRA adapter merged in (W + scale B A; dropout is off), the
    sum PEFT's merge_and_unload stores. `whole` maps each weight first (an FSDP2 shard gathered)."""
    def get(t):
        return t if whole is None else whole(t)

    base = getattr(linear, "base_layer", linear)
    w = get(base.weight)
    for name in getattr(linear, "active_adapters", ()):
        if name in getattr(linear, "lora_A", {}):
            w = w + linear.scaling[name] * (get(linear.lora_B[name].weight)
                                            @ get(linear.lora_A[name].weight))
    return w, base.bias


def joined(mods, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The projections `mods` as one matrix (their outputs concatenated) and bias, LoRA merged, in
    `dtype`, stored transposed ((in, out) in memory, as the decode step's matmul reads it)."""
    parts = [merged(m) for m in mods]
    biases = None if all(b is None for _, b in parts) else torch.cat(
        [b if b is not None else w.new_zeros(w.size(0)) for w, b in parts]).to(dtype)
    return torch.cat([w for w, _ in parts]).to(dtype).t().contiguous().t(), biases


def cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)
