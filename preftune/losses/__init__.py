"""Training losses: pure functions of tensors. Loaded on first use, so `preftune.losses.names`
(what the config reads) imports no torch."""
import importlib

_HOMES = {"grpo_loss": "preftune.losses.grpo", "dpo_loss": "preftune.losses.dpo",
          "sft_loss": "preftune.losses.sft", "kto_loss": "preftune.losses.kto"}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
