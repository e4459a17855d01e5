"""Which class of preftune's own module runs a model, by its config's `model_type`, or why the
Hugging Face module runs it instead. One table; each family says what it cannot run."""
from __future__ import annotations

from preftune.model.core import CausalLM
from preftune.model.glm4 import Glm4
from preftune.model.llama import Llama
from preftune.model.qwen3_moe import Qwen3Moe

FAMILIES: dict[str, type[CausalLM]] = {
    t: cls for cls in (Llama, Glm4, Qwen3Moe) for t in cls.ARCHITECTURES
}


def own_class(config) -> type[CausalLM] | None:
    """The own module's class for `config`, or None (then `unsupported` says why)."""
    cls = FAMILIES.get(getattr(config, "model_type", None))
    return cls if cls is not None and cls.unsupported(config) is None else None


def unsupported(config) -> str | None:
    """Why the own module cannot run a model of `config`, or None."""
    cls = FAMILIES.get(getattr(config, "model_type", None))
    if cls is None:
        own = ", ".join(sorted(FAMILIES))
        return f"model_type {getattr(config, 'model_type', None)!r} (own module: {own})"
    return cls.unsupported(config)
