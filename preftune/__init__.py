"""preftune: preference and reward fine-tuning for language models.

The public surface: `train`, `load_config`, `TrainResult`, the config dataclasses (`Config`,
`ModelConfig`, `LoraConfig`, `DataConfig`, `GRPOConfig`, `DPOConfig`, `SFTConfig`, `OptimConfig`,
`EvalConfig`, `GateConfig`, `LogConfig`, `DistributedConfig`, `DeployConfig`), `losses.grpo_loss`,
`losses.dpo_loss`, and the errors a run ends with: `UserError` (78), `Preempted` and `TryAgain` (75:
run again), `Unavailable` (69: a service unreachable). Everything else is internal. Names are
imported on first use, so `import preftune` stays light (no torch).
"""
import importlib

__version__ = "0.1.0"

_CONFIG_CLASSES = ("Config", "ModelConfig", "LoraConfig", "DataConfig", "GRPOConfig",
                   "DPOConfig", "SFTConfig",
                   "OptimConfig", "EvalConfig", "GateConfig", "LogConfig",
                   "DistributedConfig", "DeployConfig")
_HOMES = {"train": "preftune.api", "load_config": "preftune.config", "TrainResult": "preftune.api",
          "UserError": "preftune.errors",
          "Preempted": "preftune.errors", "TryAgain": "preftune.errors",
          "Unavailable": "preftune.errors", **dict.fromkeys(_CONFIG_CLASSES, "preftune.config")}
__all__ = ["losses", *_HOMES]


def __getattr__(name: str):
    if name == "losses":
        return importlib.import_module("preftune.losses")
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'preftune' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
