"""preftune's own model of the Llama family (Llama, Qwen2, Qwen3, Mistral): one plain module per
block, no distributed code inside (FSDP2, activation checkpointing and LoRA are applied from
outside), the parameter names of the Hugging Face module, so it loads and saves the same folders.

One model for every pass: the training and reference passes (`forward`: packed rows, plain causal
or tree-masked, the vocabulary projection inside so FSDP2 holds the whole head there), prefill
(`forward` writing a KV cache) and decoding (`step`: one token per row on weights fused once per
rollout). The maths is the Hugging Face module's (RMSNorm in float32, the model's own rotary
embedding, SDPA), tested equal to it in float64; RMSNorm and RoPE have hand-written backward
passes (fewer passes over the activations than autograd's).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from preftune.model.head import head_logps

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")  # model_type values this file implements
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # every linear but the head


def unsupported(config) -> str | None:
    """Why this file cannot run a model of `config` (then the Hugging Face module does), or None."""
    if getattr(config, "model_type", None) not in ARCHITECTURES:
        return f"model_type {getattr(config, 'model_type', None)!r}"
    if getattr(config, "auto_map", None):
        return "the folder brings its own modeling code"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act}"
    if getattr(config, "use_sliding_window", False) or (config.model_type == "mistral"
                                                         and getattr(config, "sliding_window", None)):
        return "sliding-window attention"
    rope = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if any(k in str(rope.get("rope_type", rope.get("type", ""))) for k in ("dynamic", "longrope")):
        return "position-dependent rotary frequencies"  # the table is built once per rollout
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout"
    return None


def _hf_layout(config):
    """The Hugging Face module of `config` on the meta device: the shapes, biases and rotary class
    this model mirrors (no storage, no weights read)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _linear(like: nn.Linear) -> nn.Linear:
    return nn.Linear(like.in_features, like.out_features, bias=like.bias is not None)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, like, config):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, _linear(getattr(like, name)))
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if hasattr(like, "q_norm") else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if hasattr(like, "k_norm") else None

    def forward(self, x, cos, sin, mask, kv=None, layer: int = 0, start: int = 0) -> torch.Tensor:
        """x (B, L, H) -> attention output (B, L, H). With `kv`, keys/values go to columns
        start..start+L-1 of layer `layer`'s cache and attention runs over columns 0..start+L-1."""
        B, L, _ = x.shape
        d = self.head_dim
        q, k, v = (p(x).view(B, L, -1, d) for p in (self.q_proj, self.k_proj, self.v_proj))  # (B, L, h, d)
        if self.q_norm is not None:  # Qwen3 normalises each head's q and k before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = _rotate(q, cos, sin).transpose(1, 2), _rotate(k, cos, sin).transpose(1, 2), v.transpose(1, 2)
        if kv is not None:
            kv.keys[layer, :, :, start:start + L], kv.values[layer, :, :, start:start + L] = k, v
            k, v = kv.keys[layer, :, :, :start + L], kv.values[layer, :, :, :start + L]  # (B, nkv, S, d)
        return self.o_proj(_attend(q, k, v, mask))  # (B, L, H)


class MLP(nn.Module):
    def __init__(self, like):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (_linear(getattr(like, n)) for n in
                                                        ("gate_proj", "up_proj", "down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, like, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(like.self_attn, config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(like.mlp)

    def forward(self, x, cos, sin, mask, kv=None, layer: int = 0, start: int = 0) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv, layer, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """`model.` of the Hugging Face names: embeddings, blocks, final norm, rotary table."""

    def __init__(self, like, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(layer, config) for layer in like.layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = type(like.rotary_emb)(config)  # the model's own frequencies (buffers only)


class Llama(nn.Module):
    """A Llama-family causal LM. `autocast_dtype`: bf16 compute over float32 master weights."""

    def __init__(self, config, *, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        like = _hf_layout(config)
        self.config, self.autocast_dtype, self.checkpointing = config, autocast_dtype, False
        self.model = Decoder(like.model, config)
        self.lm_head = _linear(like.lm_head)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, L, 1, d) for position ids (B, L), as the module's rotary embedding computes them."""
        cos, sin = self.model.rotary_emb(self.model.embed_tokens.weight[:1], positions)  # (B, L, d)
        return cos.unsqueeze(2), sin.unsqueeze(2)

    def hidden(self, ids, positions, mask=None, kv=None, start: int = 0) -> torch.Tensor:
        """Hidden states before the final norm (B, L, H). mask: boolean (B, 1, L, S), True where a
        query may attend a key, or None for plain causal attention over the L tokens."""
        if mask is not None and ids.size(1) > 1:  # SDPA turns a boolean mask additive: once, not per layer
            mask = torch.zeros(mask.shape, dtype=self.model.embed_tokens.weight.dtype,
                               device=ids.device).masked_fill_(~mask, float("-inf"))
        cos, sin = self.rope(positions)
        x = self.model.embed_tokens(ids)  # (B, L, H)
        for i, block in enumerate(self.model.layers):
            if self.checkpointing and torch.is_grad_enabled():  # recompute the block in backward
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, mask, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask, kv, i, start)
        return x

    def forward(self, ids, positions, mask=None, *, kv=None, index=None, targets=None, temperature: float = 1.0,
                with_entropy: bool = False, top_k: int = 0, top_p: float = 1.0, stats: bool = False):
        """Log-probs (K,) of `targets` (K,) predicted at flat positions `index` (K,) of the rows
        (R, L), and optionally the entropy; the final norm and the (chunked) vocabulary projection
        run here, inside the root module, so a sharded head is whole for them. Without `index`, the
        hidden states (a prefill writing `kv`). Every pass enters here: FSDP2 runs the root's hooks."""
        if index is None:
            return self.hidden(ids, positions, mask, kv=kv)  # (R, L, H)
        h = self.hidden(ids, positions, mask).flatten(0, 1)[index]  # (K, H)
        return head_logps(self.model.norm(h), self.lm_head, targets, temperature=temperature,
                          with_entropy=with_entropy, top_k=top_k, top_p=top_p, stats=stats)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))  # (..., V)

    # ---------------------------------------------------------------- decoding

    def new_kv(self, rows: int, capacity: int, dtype: torch.dtype) -> KVBuffers:
        a = self.model.layers[0].self_attn
        shape = (len(self.model.layers), rows, a.kv_heads, capacity, a.head_dim)
        w = self.model.embed_tokens.weight
        return KVBuffers(w.new_empty(shape, dtype=dtype), w.new_empty(shape, dtype=dtype))

    def decoding(self, dtype: torch.dtype) -> list[dict]:
        """Each block's weights for `step`, read once per rollout: q/k/v and gate/up fused into one
        matrix each (a copy that serves every token), LoRA adapters merged, in `dtype`."""
        return [_fused(block, dtype) for block in self.model.layers]

    def step(self, tok, cos, sin, mask, kv: KVBuffers, col: int, weights: list[dict]) -> torch.Tensor:
        """One new token per row -> logits (n, V). tok (n,); cos, sin (n, d), the new positions'
        rotary rows; mask (n, S) boolean over cache columns 0..col (S = col + 1), the new one
        included. Residual adds run inside the projections' matmuls (addmm) and attention is one
        baddbmm with an additive mask built once per step: a small model's decode step costs per
        tensor op more than per FLOP."""
        a = self.model.layers[0].self_attn
        n, d, nh, nkv, S = tok.size(0), a.head_dim, a.heads, a.kv_heads, mask.size(1)
        if S != col + 1:  # wider would read unwritten columns
            raise ValueError(f"step: the mask covers {S} columns, the cache {col + 1}")
        low = weights[0]["qkv"].dtype
        wide = torch.promote_types(low, torch.float32)  # softmax at least in float32
        cos, sin = cos[:, None].to(low), sin[:, None].to(low)  # (n, 1, d)
        bias = torch.zeros(mask.shape, dtype=low, device=tok.device).masked_fill_(~mask, float("-inf"))  # (n, S)
        bias = bias[:, None, None].expand(n, nkv, 1, S).reshape(n * nkv, 1, S)  # each key head's rows
        x = F.embedding(tok, self.model.embed_tokens.weight)  # (n, H): the residual in the master dtype
        for i, w in enumerate(weights):
            qkv = _addmm(w["qkv_bias"], rms(x, w["norm1"], w["eps"]).to(low), w["qkv"])  # (n, (nh + 2 nkv) d)
            q, k, v = qkv.view(n, nh + 2 * nkv, d).split((nh, nkv, nkv), 1)
            if w["q_norm"] is not None:
                q, k = rms(q, w["q_norm"], w["eps"]), rms(k, w["k_norm"], w["eps"])
            q, k = _rotate_into(q * cos, q, sin), _rotate_into(k * cos, k, sin)  # (n, nh | nkv, d)
            kv.keys[i, :, :, col], kv.values[i, :, :, col] = k, v
            keys = kv.keys[i, :, :, :S].reshape(n * nkv, S, d)  # a view: rows and heads merge
            values = kv.values[i, :, :, :S].reshape(n * nkv, S, d)  # (n nkv, S, d)
            scores = torch.baddbmm(bias, q.reshape(n * nkv, nh // nkv, d), keys.transpose(1, 2),
                                   alpha=d ** -0.5)  # (n nkv, g, S)
            probs = scores.to(wide).softmax(-1).to(values.dtype)  # (n nkv, g, S)
            x = _addmm(x, torch.bmm(probs, values).view(n, nh * d), w["o"], w["o_bias"])
            gate, up = _addmm(w["gate_up_bias"], rms(x, w["norm2"], w["eps"]).to(low), w["gate_up"]).chunk(2, -1)
            x = _addmm(x, F.silu(gate) * up, w["down"], w["down_bias"])  # (n, H)
        return F.linear(rms(x, self.model.norm.weight, self.model.norm.eps).to(low),
                        self.lm_head.weight.to(low))  # (n, V)

    # ---------------------------------------------------------------- Hugging Face folders

    @classmethod
    def of(cls, module, *, autocast_dtype=None) -> "Llama":
        """This model holding a copy of a Hugging Face module's weights (its dtype and device)."""
        w = next(module.parameters())
        with _default_dtype(w.dtype), torch.device(w.device):
            model = cls(module.config, autocast_dtype=autocast_dtype)
        model.load_state_dict(module.state_dict())
        return model.train(module.training)

    @classmethod
    def from_pretrained(cls, path: str | Path, config, *, dtype: torch.dtype, autocast_dtype=None,
                        weights: bool = True) -> "Llama":
        """The model of a Hugging Face folder (the safetensors files `weight_files` names); without
        `weights`, on the meta device (shapes only: FSDP2 ranks receive their shards)."""
        with _default_dtype(dtype), torch.device("meta") if not weights else contextlib.nullcontext():
            model = cls(config, autocast_dtype=autocast_dtype)  # parameters in `dtype`, rotary tables float32
        if not weights:
            return model
        from safetensors.torch import load_file

        state = {}
        for f in weight_files(Path(path)):
            state.update(load_file(str(f)))
        if not state:
            raise OSError(f"no model.safetensors (or model.safetensors.index.json) in {path}")
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (model.tied and k == "lm_head.weight")]
        if missing or unexpected:
            raise KeyError(f"weights do not fit {config.model_type}: missing {missing[:3]}, unexpected "
                           f"{unexpected[:3]}")
        return model

    def save_pretrained(self, out: str | Path, *, safe_serialization: bool = True, state_dict=None) -> None:
        """config.json and model.safetensors, as `from_pretrained` of transformers reads them."""
        from safetensors.torch import save_file

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        state = dict(self.state_dict() if state_dict is None else state_dict)
        if self.tied:
            state.pop("lm_head.weight", None)
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        self.config.save_pretrained(str(out))
        dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(cfg | {"dtype": dtype}, indent=2) + "\n")

    def get_output_embeddings(self):
        return self.lm_head


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face folder: those model.safetensors.index.json names when it
    is there, else model.safetensors. Never a glob: a file planted beside them is never read."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return [folder / "model.safetensors"] if (folder / "model.safetensors").is_file() else []
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index.name} is not a weight index ({type(e).__name__})") from None
    if not all(isinstance(n, str) and "/" not in n and n.endswith(".safetensors") for n in names):
        raise ValueError(f"{index.name} names files outside the folder or not safetensors")
    return [folder / n for n in names]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


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


def _weight(linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A projection's weight and bias, a LoRA adapter merged in (W + scale B A; dropout is off)."""
    base = getattr(linear, "base_layer", linear)
    w = base.weight
    for name in getattr(linear, "active_adapters", ()):
        if name in getattr(linear, "lora_A", {}):
            w = w + linear.scaling[name] * (linear.lora_B[name].weight @ linear.lora_A[name].weight)
    return w, base.bias


def _fused(block: Block, dtype: torch.dtype) -> dict:
    a, mlp = block.self_attn, block.mlp

    def join(mods):
        parts = [_weight(m) for m in mods]
        biases = None if all(b is None for _, b in parts) else torch.cat(
            [b if b is not None else w.new_zeros(w.size(0)) for w, b in parts]).to(dtype)
        # stored transposed, (in, out) in memory, as the matmul reads it
        return torch.cat([w for w, _ in parts]).to(dtype).t().contiguous().t(), biases

    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    qkv, qkv_bias = join((a.q_proj, a.k_proj, a.v_proj))
    gate_up, gate_up_bias = join((mlp.gate_proj, mlp.up_proj))
    (o, o_bias), (down, down_bias) = _weight(a.o_proj), _weight(mlp.down_proj)
    return {"qkv": qkv, "qkv_bias": qkv_bias, "o": cast(o), "o_bias": cast(o_bias), "gate_up": gate_up,
            "gate_up_bias": gate_up_bias, "down": cast(down), "down_bias": cast(down_bias),
            "norm1": block.input_layernorm.weight, "norm2": block.post_attention_layernorm.weight,
            "eps": block.input_layernorm.eps, "q_norm": a.q_norm and cast(a.q_norm.weight),
            "k_norm": a.k_norm and cast(a.k_norm.weight)}


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the HF module computes it: in float32 (even for float64 weights), then the weight."""
    if x.dtype == torch.float32 and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)  # the same forward, a shorter backward
    h = x.to(torch.float32)  # a no-op for float32
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _addmm(base: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """base + x @ weight.T (+ bias) for 2-D x (n, in): one matmul that adds (base None: x @ weight.T).
    A float32 residual over bf16 products (mixed precision) keeps its dtype, as under autocast."""
    if base is None or base.dtype != x.dtype:
        out = torch.mm(x, weight.t())
        out = out if bias is None else out + bias
        return out if base is None else base + out.to(base.dtype)
    out = torch.addmm(base, x, weight.t())
    return out if bias is None else out + bias


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
    """Softmax attention with grouped keys/values -> (B, L, nh d). q (B, nh, L, d), k/v (B, nkv, S, d);
    mask additive (B, 1, L, S), or None for causal attention (SDPA's flash kernel on CUDA)."""
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
