"""Typed run configuration: one dataclass per component (`schema.py`), each key declared once
(`fields.knob`), YAML as its serialisation (`load.py`). Importing it imports no torch.

`python -m preftune.config` writes docs/config.md from the declarations.
"""
from preftune.config.fields import Interval, check_section, declared, from_dict, reference, to_dict
from preftune.config.load import (apply_override, build_config, check_key, check_output_dir,
                                  load_config, read_source,
                                  resolve_local, resolve_reward_file, to_yaml,
                                  validate, yaml_problem)
from preftune.config.schema import (TRACKERS, Config, DataConfig, DeployConfig,
                                    DistributedConfig, DPOConfig,
                                    EvalConfig, GateConfig, GRPOConfig,
                                    KTOConfig, LogConfig, LoraConfig,
                                    ModelConfig, OptimConfig, SFTConfig)

# Views of the declarations, by dotted key (derived: the fields stay the one home of each fact)
CHOICES = declared(Config, "choices")
BOUNDS = declared(Config, "range")

__all__ = ["Config", "LoraConfig", "ModelConfig", "DataConfig", "GRPOConfig", "DPOConfig",
           "KTOConfig", "SFTConfig",
           "OptimConfig", "EvalConfig", "GateConfig", "LogConfig",
           "DistributedConfig", "DeployConfig",
           "TRACKERS", "CHOICES", "BOUNDS", "Interval", "load_config",
           "build_config", "read_source",
           "apply_override", "validate", "check_key", "check_section", "check_output_dir",
           "from_dict", "to_dict",
           "to_yaml", "resolve_local", "resolve_reward_file", "yaml_problem", "reference"]
