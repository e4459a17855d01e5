"""GLM-4 (`Glm4ForCausalLM`: GLM-4-9B/32B-0414) in preftune's own module. What differs from the
Llama family, beside the shared `core`: four RMSNorms per block (a post-norm on the attention's
and on the MLP's output before each residual add), RoPE on the first `partial_rotary_factor` of
each head over adjacent channel pairs (`ops.rotate_pairs`), one fused `gate_up_proj`, q/k/v biases
per `attention_bias` and none on o_proj. LoRA's "all-linear" here is q/k/v/o_proj, gate_up_proj and
down_proj: a `target_modules` list names `gate_up_proj` (there is no gate_proj or up_proj)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from preftune.model import hf_config
from preftune.model.core import Attention, Block, CausalLM, Step
from preftune.model.ops import RMSNorm, addmm, cast, merged, rms, rotate_pairs


class PairAttention(Attention):
    """Attention with GLM's rotary: adjacent pairs of the first r channels of each head."""

    rotate = staticmethod(rotate_pairs)
    rotate_step = staticmethod(rotate_pairs)


class FusedMLP(nn.Module):
    """SwiGLU from one `gate_up_proj` (gate first, then up) and `down_proj`."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.silu(gate))

    def fused(self, dtype: torch.dtype) -> dict:
        (gate_up, gate_up_bias), (down,
                                  down_bias) = merged(self.gate_up_proj), merged(self.down_proj)
        return {"gate_up": cast(gate_up, dtype), "gate_up_bias": cast(gate_up_bias, dtype),
                "down": cast(down, dtype), "down_bias": cast(down_bias, dtype)}

    def step(self, residual: torch.Tensor | None, h: torch.Tensor, w: dict) -> torch.Tensor:
        gate, up = addmm(w["gate_up_bias"], h, w["gate_up"]).chunk(2, -1)
        return addmm(residual, up * F.silu(gate), w["down"], w["down_bias"])  # (n, H)


class PostNormBlock(Block):
    """x + post_norm(attn(norm(x))), then x + post_norm(mlp(norm(x))) (GLM-4's sandwich)."""

    def __init__(self, config, attention: nn.Module, mlp: nn.Module):
        super().__init__(config, attention, mlp)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, kv=None, layer: int = 0, start: int = 0) -> torch.Tensor:
        x = x + self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(x), cos, sin,
                                                             mask, kv, layer, start))
        return x + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x)))

    def fused(self, dtype: torch.dtype) -> dict:
        return super().fused(dtype) | {"post_attn": self.post_self_attn_layernorm.weight,
                                       "post_mlp": self.post_mlp_layernorm.weight}

    def step(self, x: torch.Tensor, w: dict, s: Step, layer: int) -> torch.Tensor:
        eps = w["eps"]
        a = self.self_attn.step(rms(x, w["norm1"], eps).to(s.low), w, s, layer, eps)  # (n, nh d)
        x = x + rms(addmm(None, a, w["o"], w["o_bias"]), w["post_attn"], eps)
        # (n, H)
        return x + rms(self.mlp.step(None, rms(x, w["norm2"], eps).to(s.low),
                                     w), w["post_mlp"], eps)


class Glm4(CausalLM):
    """A GLM-4 causal LM with the Hugging Face parameter names."""

    ARCHITECTURES = ("glm4",)
    # every linear but the head
    PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")

    def block(self, config, index: int) -> Block:
        return PostNormBlock(config, PairAttention(config, hf_config.layout(config)),
                             FusedMLP(config.hidden_size, config.intermediate_size))
