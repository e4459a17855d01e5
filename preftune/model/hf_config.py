"""config.json of a model folder read without transformers, for the families of the own module,
and what it implies about the module beyond its sizes (`layout`): for the own module and the plan.

Importing a transformers config class imports its whole modeling stack (its docstring decorator
loads the auto classes, and with them dynamo and sympy): most of a restart's start-up. The own
module needs only the numbers in config.json, so it reads them here. Keys the file leaves out take
transformers 5's defaults for that model type (`DEFAULTS`; tests/model/test_hf_config.py holds
them to its config classes). A file this reader cannot match exactly (a rotary table other than
the default, its own code, a key the family needs missing) is left to transformers: `read`
returns None.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Per model type, what transformers 5's config class takes for a key config.json does not give.
_COMMON = {"hidden_act": "silu", "attention_dropout": 0.0, "tie_word_embeddings": False,
           "rope_theta": 10000.0}
DEFAULTS: dict[str, dict] = {
    "llama": _COMMON | {"attention_bias": False, "mlp_bias": False, "rms_norm_eps": 1e-6},
    "qwen2": _COMMON | {"rms_norm_eps": 1e-6, "use_sliding_window": False,
                        "sliding_window": None},
    "qwen3": _COMMON | {"attention_bias": False, "rms_norm_eps": 1e-6, "head_dim": 128,
                        "use_sliding_window": False, "sliding_window": None},
    "mistral": _COMMON | {"rms_norm_eps": 1e-6, "sliding_window": 4096},
    "glm4": _COMMON | {"attention_bias": True, "rms_norm_eps": 1.5625e-07, "head_dim": 128,
                       "partial_rotary_factor": 0.5},
    "qwen3_moe": _COMMON | {"attention_bias": False, "rms_norm_eps": 1e-6,
                            "use_sliding_window": False, "sliding_window": None,
                            "norm_topk_prob": False, "decoder_sparse_step": 1,
                            "mlp_only_layers": [], "output_router_logits": False,
                            "router_aux_loss_coef": 0.001},
}
# what the file must give: the sizes (their defaults are some published model's, never this one's)
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads")
REQUIRED_MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
# transformers 5 writes some keys under another name than older files: (the name read, the other)
ALIASES = {"qwen3_moe": [("num_experts", "num_local_experts")]}


class FolderConfig:
    """config.json's keys as attributes (what a transformers config offers the own module):
    `to_dict`, `get` and `save_pretrained`, which writes them back as config.json."""

    def __init__(self, values: dict):
        self.__dict__.update(values)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def get(self, key: str, default=None):
        return self.__dict__.get(key, default)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "FolderConfig":
        """The folder's config.json as it stands (what PEFT asks of a base model's config)."""
        return read(folder) or cls(json.loads((Path(folder) / "config.json").read_text()))

    def save_pretrained(self, out: str | Path) -> None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def __repr__(self) -> str:
        return f"FolderConfig({self.to_dict()})"


def _rope(values: dict, model_type: str) -> dict | None:
    """rope_parameters as transformers 5 standardises them, or None for a table other than the
    default (its published formulas live in transformers)."""
    tables = [values.get("rope_parameters") or {}, values.get("rope_scaling") or {}]
    if any(t.get("rope_type", t.get("type", "default")) != "default" for t in tables):
        return None
    rope = tables[0] or tables[1]
    theta = rope.get("rope_theta", values.get("rope_theta", DEFAULTS[model_type]["rope_theta"]))
    out = {"rope_theta": float(theta), "rope_type": "default"}
    if "partial_rotary_factor" in DEFAULTS[model_type]:
        out["partial_rotary_factor"] = rope.get(
            "partial_rotary_factor",
            values.get("partial_rotary_factor", DEFAULTS[model_type]["partial_rotary_factor"]))
    return out


def read(folder: str | Path) -> FolderConfig | None:
    """The folder's config.json for the own module, or None when transformers must read it.
    A file that is not JSON raises ValueError (the loader reports it)."""
    values = json.loads((Path(folder) / "config.json").read_text())
    model_type = values.get("model_type")
    if model_type not in DEFAULTS or values.get("auto_map"):
        return None
    for name, other in ALIASES.get(model_type, []):
        if values.get(name) is None and values.get(other) is not None:
            values[name] = values[other]
    required = REQUIRED + (REQUIRED_MOE if model_type == "qwen3_moe" else ())
    if any(values.get(k) is None for k in required):
        return None
    rope = _rope(values, model_type)
    if rope is None:
        return None
    out = DEFAULTS[model_type] | values
    out.pop("rope_scaling", None)
    out.pop("rope_theta", None)
    out["rope_parameters"] = rope
    out["_name_or_path"] = str(folder)
    return FolderConfig(out)


@dataclass(frozen=True)
class Layout:
    """What a model type's Hugging Face module holds beyond config.json's sizes: which
    projections have a bias, and whether q and k are normed per head (from transformers'
    modeling files; the own module's parity tests, tests/model/test_llama.py, hold it there)."""

    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool


def layout(config) -> Layout | None:
    """`config`'s layout (a transformers config or a `FolderConfig`), or None for a model type
    the own module does not know."""
    bias = bool(getattr(config, "attention_bias", DEFAULTS.get(config.model_type, {}).get(
        "attention_bias", False)))
    return {"llama": Layout(bias, bias, bool(getattr(config, "mlp_bias", False)), False),
            "qwen2": Layout(True, False, False, False),  # q/k/v biases, always
            "qwen3": Layout(bias, bias, False, True),
            "mistral": Layout(False, False, False, False),
            "glm4": Layout(bias, False, False, False),
            "qwen3_moe": Layout(bias, bias, False, True)}.get(config.model_type)
