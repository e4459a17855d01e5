"""A model's weights as a rollout engine reloads them: whole, one tensor at a time, under their
Hugging Face names (`hf_weights`)."""
from __future__ import annotations

from preftune.distributed.weights import full_tensor
from preftune.model import load as loader


def hf_weights(model):
    """(name, tensor) of every weight under its Hugging Face checkpoint name, whole, one at a time
    (a rollout engine's reload streams them): module order, so every rank gathers the same
    parameter at the same moment; LoRA merged into its base weight (W + scaling * B A); a tied
    weight once."""
    base, seen, lora = loader.base_module(model), set(), []
    for prefix, mod in base.named_modules():
        if any(prefix.startswith(p + ".") for p in lora):
            continue
        dot = f"{prefix}." if prefix else ""
        if hasattr(mod, "base_layer") and hasattr(mod, "lora_A"):  # a PEFT LoRA layer
            lora.append(prefix)
            w = full_tensor(mod.base_layer.weight)
            for key in mod.active_adapters:
                # (r, in), (out, r)
                a, b = full_tensor(mod.lora_A[key].weight), full_tensor(mod.lora_B[key].weight)
                w = w + (b.float() @ a.float()).mul_(mod.scaling[key]).to(w.dtype)  # (out, in)
            yield f"{dot}weight", w
            if getattr(mod.base_layer, "bias", None) is not None:
                yield f"{dot}bias", full_tensor(mod.base_layer.bias)
            continue
        for name, p in mod.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield f"{dot}{name}", full_tensor(p)
