"""The Llama family (Llama, Qwen2, Qwen3, Mistral without a sliding window) in preftune's own
module: pre-norm blocks (`core.Block`), grouped-query attention with rotate-half RoPE over the
whole head (q/k norms for Qwen3), SwiGLU with separate gate/up projections. Everything else is
`core.CausalLM`'s: the passes, the decode loop, Hugging Face folders."""
from __future__ import annotations

from preftune.model import hf_config
from preftune.model.core import MLP, Attention, Block, CausalLM


class Llama(CausalLM):
    """A Llama-family causal LM with the Hugging Face parameter names."""

    # model_type values this family implements
    ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
    # every linear but the head (LoRA's "all-linear")
    PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    @classmethod
    def unsupported(cls, config) -> str | None:
        """Why this family cannot run a model of `config` (then the Hugging Face module does), or
        None."""
        why = super().unsupported(config)
        mistral_window = config.model_type == "mistral" and getattr(config, "sliding_window", None)
        if why is None and (getattr(config, "use_sliding_window", False) or mistral_window):
            return "sliding-window attention"
        return why

    def block(self, config, index: int) -> Block:
        layout = hf_config.layout(config)
        return Block(config, Attention(config, layout),
                     MLP(config.hidden_size, config.intermediate_size, layout.mlp_bias))


ARCHITECTURES, PROJECTIONS, unsupported = Llama.ARCHITECTURES, Llama.PROJECTIONS, Llama.unsupported
