"""What every family of preftune's own module shares: the attention core, the pre-norm block, the
decoder, and `CausalLM` (the passes, the decode loop, Hugging Face folders). A family
(`llama.py`, `glm4.py`, `qwen3_moe.py`) says only what differs: its block, its MLP, its rotary.

One model for every pass: the training and reference passes (`forward`: packed rows, plain causal
or tree-masked, the vocabulary projection inside so FSDP2 holds the whole head there), prefill
(`forward` writing a KV cache) and decoding (`step`: one token per row on weights fused once per
rollout). No distributed code inside: FSDP2, activation checkpointing and LoRA apply from outside.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from preftune.model.head import head_logps
from preftune.model import hf_files
from preftune.model.hf_config import Layout
from preftune.model.hf_files import weight_files
from preftune.model.ops import (KVBuffers, RMSNorm, Rotary, addmm, attend, cast, joined,
                                merged, rms, rotate_half, rotate_half_step)


def common_unsupported(config, architectures: tuple[str, ...]) -> str | None:
    """What no family of the own module runs (then the Hugging Face module does), or None."""
    if getattr(config, "model_type", None) not in architectures:
        return f"model_type {getattr(config, 'model_type', None)!r}"
    if getattr(config, "auto_map", None):
        return "the folder brings its own modeling code"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act}"
    rope = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if any(k in str(rope.get("rope_type", rope.get("type", ""))) for k in ("dynamic", "longrope")):
        return "position-dependent rotary frequencies"  # the table is built once per rollout
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout"
    return None


@dataclass
class Step:
    """What every block's decode step shares for one token per row: sizes, the additive mask
    (n nkv, 1, S), the rotary rows (n, 1, r), the cache and its column, the dtypes."""

    n: int
    S: int
    col: int
    bias: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    kv: KVBuffers
    low: torch.dtype
    wide: torch.dtype


class Attention(nn.Module):
    """Grouped-query attention with the HF names; `rotate` (training) and `rotate_step` (decode)
    are the family's rotary; q_norm/k_norm when the HF module has them (Qwen3)."""

    rotate = staticmethod(rotate_half)
    rotate_step = staticmethod(rotate_half_step)

    def __init__(self, config, layout: Layout):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        H, q, kv = config.hidden_size, self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(H, q, bias=layout.qkv_bias)
        self.k_proj = nn.Linear(H, kv, bias=layout.qkv_bias)
        self.v_proj = nn.Linear(H, kv, bias=layout.qkv_bias)
        self.o_proj = nn.Linear(q, H, bias=layout.o_bias)
        norm = layout.qk_norm
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if norm else None

    def forward(self, x, cos, sin, mask, kv=None, layer: int = 0, start: int = 0) -> torch.Tensor:
        """x (B, L, H) -> attention output (B, L, H). With `kv`, keys/values go to columns
        start..start+L-1 of layer `layer`'s cache and attention runs over columns 0..start+L-1."""
        B, L, _ = x.shape
        d = self.head_dim
        # (B, L, h, d)
        q, k, v = (p(x).view(B, L, -1, d) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.q_norm is not None:  # Qwen3 normalises each head's q and k before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (
            self.rotate(q, cos, sin).transpose(1, 2),
            self.rotate(k, cos, sin).transpose(1, 2),
            v.transpose(1, 2),
        )
        if kv is not None:
            kv.keys[layer, :, :, start:start + L], kv.values[layer, :, :, start:start + L] = k, v
            # (B, nkv, S, d)
            k, v = kv.keys[layer, :, :, :start + L], kv.values[layer, :, :, :start + L]
        return self.o_proj(attend(q, k, v, mask))  # (B, L, H)

    def fused(self, dtype: torch.dtype) -> dict:
        (qkv, qkv_bias), (o, o_bias) = joined((self.q_proj, self.k_proj, self.v_proj),
                                              dtype), merged(self.o_proj)
        return {"qkv": qkv, "qkv_bias": qkv_bias, "o": cast(o, dtype),
                "o_bias": cast(o_bias, dtype),
                "q_norm": self.q_norm and cast(self.q_norm.weight, dtype),
                "k_norm": self.k_norm and cast(self.k_norm.weight, dtype)}

    def step(self, h: torch.Tensor, w: dict, s: Step, layer: int, eps: float) -> torch.Tensor:
        """The decode step's attention before o_proj: normed h (n, H) in the low dtype -> (n, nh d).
        One baddbmm for the scores under the additive mask, keys/values written in place."""
        n, d, nh, nkv = s.n, self.head_dim, self.heads, self.kv_heads
        qkv = addmm(w["qkv_bias"], h, w["qkv"])  # (n, (nh + 2 nkv) d)
        q, k, v = qkv.view(n, nh + 2 * nkv, d).split((nh, nkv, nkv), 1)
        if w["q_norm"] is not None:
            q, k = rms(q, w["q_norm"], eps), rms(k, w["k_norm"], eps)
        # (n, nh | nkv, d)
        q, k = self.rotate_step(q, s.cos, s.sin), self.rotate_step(k, s.cos, s.sin)
        s.kv.keys[layer, :, :, s.col], s.kv.values[layer, :, :, s.col] = k, v
        keys = s.kv.keys[layer, :, :, :s.S].reshape(n * nkv, s.S, d)  # a view: rows and heads merge
        values = s.kv.values[layer, :, :, :s.S].reshape(n * nkv, s.S, d)  # (n nkv, S, d)
        scores = torch.baddbmm(s.bias, q.reshape(n * nkv, nh // nkv, d), keys.transpose(1, 2),
                               alpha=d ** -0.5)  # (n nkv, g, S)
        probs = scores.to(s.wide).softmax(-1).to(values.dtype)  # (n nkv, g, S)
        return torch.bmm(probs, values).view(n, nh * d)


class MLP(nn.Module):
    """SwiGLU with separate gate/up projections (Llama family, dense Qwen3-MoE layers)."""

    def __init__(self, hidden: int, inner: int, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fused(self, dtype: torch.dtype) -> dict:
        (gate_up, gate_up_bias), (down,
                                  down_bias) = joined((self.gate_proj, self.up_proj), dtype), \
            merged(self.down_proj)
        return {"gate_up": gate_up, "gate_up_bias": gate_up_bias, "down": cast(down, dtype),
                "down_bias": cast(down_bias, dtype)}

    def step(self, residual: torch.Tensor | None, h: torch.Tensor, w: dict) -> torch.Tensor:
        """residual + the MLP of normed h (n, H), the add inside the down projection's matmul."""
        gate, up = addmm(w["gate_up_bias"], h, w["gate_up"]).chunk(2, -1)
        return addmm(residual, F.silu(gate) * up, w["down"], w["down_bias"])  # (n, H)


class Block(nn.Module):
    """A pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). `attention`, `mlp`: the
    family's."""

    def __init__(self, config, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x, cos, sin, mask, kv=None, layer: int = 0, start: int = 0,
                routes=None) -> torch.Tensor:
        """routes (B, L, k): a mixture of experts' recorded experts for these tokens, or None."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv, layer, start)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h) if routes is None else self.mlp(h, routes))

    def fused(self, dtype: torch.dtype) -> dict:
        """This block's weights for `step`, read once per rollout: q/k/v and gate/up fused into one
        matrix each (a copy that serves every token), LoRA adapters merged, in `dtype`."""
        return self.self_attn.fused(dtype) | self.mlp.fused(dtype) | {
            "norm1": self.input_layernorm.weight, "norm2": self.post_attention_layernorm.weight,
            "eps": self.input_layernorm.eps}

    def step(self, x: torch.Tensor, w: dict, s: Step, layer: int) -> torch.Tensor:
        """One token per row through the block: residual adds inside the projections' matmuls."""
        eps = w["eps"]
        x = addmm(x,
                  self.self_attn.step(rms(x, w["norm1"], eps).to(s.low), w, s, layer,
                                      eps), w["o"], w["o_bias"])
        return self.mlp.step(x, rms(x, w["norm2"], eps).to(s.low), w)  # (n, H)


class Decoder(nn.Module):
    """`model.` of the Hugging Face names: embeddings, blocks, final norm, rotary table."""

    def __init__(self, config, blocks: list[nn.Module], rotary: nn.Module):
        super().__init__()
        # nn.Embedding's own init, skipped on the meta device: there normal_ runs torch's Python
        # reference, which imports sympy and dynamo (a second of a restart)
        weight = torch.empty(config.vocab_size, config.hidden_size)  # (V, H)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = rotary


class CausalLM(nn.Module):
    """A causal LM of the own module. A family defines `ARCHITECTURES`, `PROJECTIONS` (LoRA's
    "all-linear"), `unsupported(config)` and `block(config, index)` (its projections' biases and
    norms from `hf_config.layout`); `rotary` is the frequency table class. `autocast_dtype`:
    bf16 compute over float32 master weights."""

    ARCHITECTURES: tuple[str, ...] = ()
    PROJECTIONS: tuple[str, ...] = ()
    # the folder's GenerationConfig (model/load.py), written back by save_pretrained
    generation_config = None
    # a mixture of experts' `RouterRecord` while a run records its routers (qwen3_moe.py)
    router_record = None
    rotary = Rotary

    def __init__(self, config, *, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.config, self.autocast_dtype, self.checkpointing = config, autocast_dtype, False
        blocks = [self.block(config, i) for i in range(config.num_hidden_layers)]
        self.model = Decoder(config, blocks, self.rotary(config))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        # per block its slot in a rollout's routes (S, k) when its MLP is routed, else None
        routed = [getattr(b.mlp, "routed", False) for b in blocks]
        self.route_slots = [sum(routed[:i]) if r else None for i, r in enumerate(routed)]

    @classmethod
    def unsupported(cls, config) -> str | None:
        return common_unsupported(config, cls.ARCHITECTURES)

    def block(self, config, index: int) -> nn.Module:
        raise NotImplementedError

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, L, 1, r) for position ids (B, L), as the module's rotary embedding computes
        them."""
        cos, sin = self.model.rotary_emb(self.model.embed_tokens.weight[:1], positions)  # (B, L, r)
        return cos.unsqueeze(2), sin.unsqueeze(2)

    def hidden(self, ids, positions, mask=None, kv=None, start: int = 0,
               routes=None) -> torch.Tensor:
        """Hidden states before the final norm (B, L, H). mask: boolean (B, 1, L, S), True where a
        query may attend a key, or None for plain causal attention over the L tokens. routes
        (B, L, S, k): the experts a rollout chose per routed layer (`route_slots`), or None."""
        # SDPA turns a boolean mask additive: once, not per layer
        if mask is not None and ids.size(1) > 1:
            mask = torch.zeros(mask.shape, dtype=self.model.embed_tokens.weight.dtype,
                               device=ids.device).masked_fill_(~mask, float("-inf"))
        cos, sin = self.rope(positions)
        x = self.model.embed_tokens(ids)  # (B, L, H)
        for i, (block, slot) in enumerate(zip(self.model.layers, self.route_slots)):
            # (B, L, k) a routed block's recorded experts, as an argument: a recompute reruns them
            kw = {} if routes is None or slot is None else {"routes": routes[:, :, slot]}
            if self.checkpointing and torch.is_grad_enabled():  # recompute the block in backward
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, mask, **kw,
                                                      use_reentrant=False)
            else:
                x = block(x, cos, sin, mask, kv, i, start, **kw)
        return x

    def forward(self, ids, positions, mask=None, *, kv=None, start: int = 0, index=None,
                targets=None,
                temperature: float = 1.0,
                with_entropy: bool = False, top_k: int = 0,
                top_p: float = 1.0, stats: bool = False, routes=None):
        """Log-probs (K,) of `targets` (K,) predicted at flat positions `index` (K,) of the rows
        (R, L), and optionally the entropy; the final norm and the (chunked) vocabulary projection
        run here, inside the root module, so a sharded head is whole for them. Without `index`, the
        hidden states (a prefill writing `kv` from column `start`, attending the columns before it).
        Every pass enters here: FSDP2 runs the root's hooks. `routes` (R, L, S, k): `hidden`'s."""
        if index is None:
            return self.hidden(ids, positions, mask, kv=kv, start=start)  # (R, L, H)
        # index_select, not h[index]: a trunk's last token predicts every branch's first token, so
        # `index` repeats positions, and the backward of h[index] adds the repeats with racing
        # atomics on CPU (run-to-run differences on a busy machine); index_add_ adds them in order
        h = self.hidden(ids, positions, mask,
                        routes=routes).flatten(0, 1).index_select(0, index)  # (K, H)
        return head_logps(self.model.norm(h), self.lm_head, targets, temperature=temperature,
                          with_entropy=with_entropy, top_k=top_k, top_p=top_p, stats=stats)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))  # (..., V)

    # ---------------------------------------------------------------- decoding

    def new_kv(self, rows: int, capacity: int, dtype: torch.dtype) -> KVBuffers:
        a = self.model.layers[0].self_attn
        shape = (len(self.model.layers), rows, a.kv_heads, capacity, a.head_dim)
        w = self.model.embed_tokens.weight
        # zeros, not empty: a conversation's later turn leaves the columns before a shorter kept
        # prefix unwritten, and a masked column still adds 0 x its value (NaN from an old heap)
        return KVBuffers(w.new_zeros(shape, dtype=dtype), w.new_zeros(shape, dtype=dtype))

    def decoding(self, dtype: torch.dtype) -> list[dict]:
        """Each block's weights for `step` (`Block.fused`), read once per rollout."""
        return [block.fused(dtype) for block in self.model.layers]

    def step(self, tok, cos, sin, mask, kv: KVBuffers, col: int,
             weights: list[dict]) -> torch.Tensor:
        """One new token per row -> logits (n, V). tok (n,); cos, sin (n, r), the new positions'
        rotary rows; mask (n, S) boolean over cache columns 0..col (S = col + 1), the new one
        included. Residual adds run inside the projections' matmuls (addmm) and attention is one
        baddbmm with an additive mask built once per step: a small model's decode step costs per
        tensor op more than per FLOP."""
        a = self.model.layers[0].self_attn
        n, nkv, S = tok.size(0), a.kv_heads, mask.size(1)
        if S != col + 1:  # wider would read unwritten columns
            raise ValueError(f"step: the mask covers {S} columns, the cache {col + 1}")
        low = weights[0]["qkv"].dtype
        # (n, S)
        bias = torch.zeros(mask.shape, dtype=low,
                           device=tok.device).masked_fill_(~mask, float("-inf"))
        # each key head's rows
        bias = bias[:, None, None].expand(n, nkv, 1, S).reshape(n * nkv, 1, S)
        s = Step(n, S, col, bias, cos[:, None].to(low), sin[:, None].to(low), kv, low,
                 torch.promote_types(low, torch.float32))  # softmax at least in float32
        # (n, H): the residual in the master dtype
        x = F.embedding(tok, self.model.embed_tokens.weight)
        for i, (block, w) in enumerate(zip(self.model.layers, weights)):
            x = block.step(x, w, s, i)
        return F.linear(rms(x, self.model.norm.weight, self.model.norm.eps).to(low),
                        self.lm_head.weight.to(low))  # (n, V)

    # ---------------------------------------------------------------- Hugging Face folders

    @classmethod
    def of(cls, module, *, autocast_dtype=None) -> "CausalLM":
        """This model holding a copy of a Hugging Face module's weights (its dtype and device)."""
        w = next(module.parameters())
        with _default_dtype(w.dtype), torch.device(w.device):
            model = cls(module.config, autocast_dtype=autocast_dtype)
        model.load_state_dict(cls.hf_state(module.state_dict(), module.config))
        return model.train(module.training)

    @classmethod
    def hf_state(cls, state: dict, config) -> dict:
        """A checkpoint's tensors under this model's names (a family with older layouts
        converts)."""
        return state

    @classmethod
    def stored_layout(cls, tensors: dict) -> dict[str, tuple[tuple, list[str]]]:
        """Parameters the files hold in another layout, by name: (shape, the stored tensors it is
        made of). None here; a family whose older checkpoints differ says (`read_stored`)."""
        return {}

    @classmethod
    def read_stored(cls, tensors: dict, name: str, start: int, stop: int,
                    dtype: torch.dtype) -> torch.Tensor:
        """Rows start..stop-1 of parameter `name` from the files, in `dtype`."""
        return hf_files.read_rows(tensors[name], name, start, stop, dtype)

    @classmethod
    def from_pretrained(cls, path: str | Path, config, *, dtype: torch.dtype, autocast_dtype=None,
                        weights: bool = True) -> "CausalLM":
        """The model of a Hugging Face folder (the safetensors files `weight_files` names); without
        `weights`, on the meta device (shapes only: FSDP2 ranks receive their shards). Built on
        the meta device, given storage, and filled one stored tensor at a time, so loading holds
        the model and one tensor, not a second copy of the weights; a layout converted on load
        (`hf_state`) reads the whole state instead."""
        with _default_dtype(dtype), torch.device("meta"):
            model = cls(config, autocast_dtype=autocast_dtype)
        if not weights:
            return model
        model.to_empty(device="cpu")
        if model.tied:  # to_empty gives the head its own storage
            model.lm_head.weight = model.model.embed_tokens.weight
        model.fill_buffers()
        tensors = hf_files.stored(path)
        if not tensors:
            raise OSError(f"no model.safetensors (or model.safetensors.index.json) in {path}")
        if hf_files.stored_as_is(model, tensors) is None:
            hf_files.read_into(model, tensors)
            return model
        from safetensors.torch import load_file

        state = {}
        for f in weight_files(Path(path)):
            state.update(load_file(str(f)))
        missing, unexpected = model.load_state_dict(cls.hf_state(state, config), strict=False)
        missing = [k for k in missing if not (model.tied and k == "lm_head.weight")]
        if missing or unexpected:
            raise KeyError(f"weights do not fit {config.model_type}: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
        return model

    def save_pretrained(self, out: str | Path, *, safe_serialization: bool = True,
                        state_dict=None) -> None:
        """config.json and model.safetensors, as `from_pretrained` of transformers reads them."""
        from safetensors.torch import save_file

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        state = dict(self.state_dict() if state_dict is None else state_dict)
        if self.tied:
            state.pop("lm_head.weight", None)
        save_file({k: v.detach().contiguous() for k, v in state.items()},
                  str(out / "model.safetensors"), metadata={"format": "pt"})
        self.config.save_pretrained(str(out))
        dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(cfg | {"dtype": dtype}, indent=2) + "\n")

    def fill_buffers(self) -> None:
        """Recompute the tables outside the state dict (the rotary frequencies) in place: a module
        built on the meta device and given storage by `to_empty` holds garbage there, and each
        rank computing them is cheaper than receiving them. Built as `from_pretrained` builds
        them (under the parameters' default dtype), so the values are the same bit for bit."""
        with _default_dtype(self.model.embed_tokens.weight.dtype):
            fresh = self.rotary(self.config)
        for name, buf in fresh.named_buffers():
            self.model.rotary_emb.get_buffer(name).copy_(buf)

    def get_output_embeddings(self):
        return self.lm_head


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
