"""Typed run configuration: one dataclass per component, YAML as its serialisation.

The dataclass defaults are the single source of truth. `load_config(path, overrides)` reads a YAML
file, applies dotted `KEY=VALUE` overrides, and rejects unknown keys with the nearest valid name.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from preftune.errors import UserError


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"


@dataclass
class ModelConfig:
    name_or_path: str = "examples/model"  # a local Hugging Face causal-LM folder
    dtype: str = "float32"  # float32 | bfloat16
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    train: str = ""  # prompts (online GRPO) or labeled traces (DPO, offline GRPO) or a pairs file
    eval: str | None = None  # held-out prompt set (prompt column + `answer` etc.) for eval/reward
    prompt_column: str = "input"
    response_column: str = "output"
    reward_column: str = "final_reward"
    reward_range: list[float] = field(default_factory=lambda: [0.0, 1.0])
    invalid: str = "error"  # error | drop: policy for invalid trace rows
    duplicates: str = "drop"  # error | drop | keep: exact duplicate trace rows
    min_reward_threshold: float | None = None
    max_prompt_length: int = 512  # prompt tokens
    prompt_truncation: str = "left"  # left | drop | error, for prompts over max_prompt_length
    shuffle: bool = True
    # DPO pairing (same meaning as `preftune data pairs`)
    chosen_min: float = 0.7
    rejected_max: float = 0.5
    pair_strategy: str = "best_vs_worst"  # best_vs_worst | all_pairs
    max_pairs_per_prompt: int | None = None
    min_margin: float = 0.0


@dataclass
class GRPOConfig:
    rollout: str = "online"  # online: sample from the policy | offline: the traces form the groups
    prompts_per_step: int = 16  # prompts in one generation batch
    num_generations: int = 8  # G completions per prompt
    micro_batch_size: int = 64  # completions per forward/backward (gradient accumulation)
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    reward_funcs: list[str] = field(default_factory=lambda: ["accuracy"])
    reward_weights: list[float] | None = None
    overlong_buffer_len: int = 0  # L_cache of the soft_overlong reward
    scale_rewards: str = "group"  # group | batch | none
    loss_type: str = "dapo"  # grpo | bnpo | dr_grpo | dapo | cispo | sapo
    beta: float = 0.0  # KL coefficient (k3); the reference model is loaded only when > 0
    epsilon: float = 0.2
    epsilon_high: float | None = None  # clip-higher (DAPO); None = epsilon
    delta: float | None = None  # two-sided clip bound
    use_bias_correction_kl: bool = False  # k3 times the ratio (TRL 1.16's default is true); false = plain k3
    importance_sampling_level: str = "token"  # token | sequence (GSPO)
    num_iterations: int = 1  # optimisation passes over one generation batch
    mask_truncated_completions: bool = False
    dynamic_sampling: bool = False  # DAPO: drop zero-spread groups, resample to fill
    max_resample_rounds: int = 4


@dataclass
class DPOConfig:
    loss_type: str | list[str] = "sigmoid"
    loss_weights: list[float] | None = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    reference_free: bool = False
    precompute_ref_logps: bool = True  # cache reference log-probs once; no reference model in memory
    max_length: int = 512  # prompt + response tokens
    batch_size: int = 16  # pairs per optimiser step
    micro_batch_size: int = 16


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    lr_scheduler: str = "linear"  # constant | linear | cosine (TRL default: linear)
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    max_grad_norm: float = 1.0  # 0 = no clipping


@dataclass
class EvalConfig:
    eval_steps: int = 0  # 0 = only before the first and after the last step
    max_new_tokens: int | None = None  # None = grpo.max_completion_length
    batch_size: int = 128
    reward_funcs: list[str] | None = None  # None = grpo.reward_funcs (weighted sum)


@dataclass
class LogConfig:
    logging_steps: int = 1
    report_to: list[str] = field(default_factory=list)  # [] | [tensorboard]
    progress_bar: bool = True


@dataclass
class DistributedConfig:
    """Data parallel under torchrun (see train/distributed.py); ignored in one plain process."""
    strategy: str = "fsdp"  # fsdp | ddp | none
    backend: str = "auto"  # auto (nccl on CUDA, else gloo) | nccl | gloo
    timeout_seconds: float = 600.0  # a collective waiting longer (a dead rank) fails the run
    reshard_after_forward: bool = True  # FSDP2: free gathered parameters after each block's forward


@dataclass
class Config:
    algorithm: str = "grpo"  # grpo | dpo
    output_dir: str = "runs/preftune"
    max_steps: int = 100
    save_steps: int = 50
    seed: int = 0
    save_total_limit: int | None = None
    resume: str = "auto"  # auto | never | a checkpoint path
    overwrite_output_dir: bool = False
    preemption_grace_seconds: float = 60.0
    checkpoint_uri: str | None = None  # fsspec URL mirrored after each complete checkpoint
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    config_dir: str = field(default=".", metadata={"internal": True})


CHOICES = {
    "algorithm": ("grpo", "dpo"),
    "model.dtype": ("float32", "bfloat16"),
    "data.invalid": ("error", "drop"),
    "data.duplicates": ("error", "drop", "keep"),
    "data.prompt_truncation": ("left", "drop", "error"),
    "data.pair_strategy": ("best_vs_worst", "all_pairs"),
    "grpo.rollout": ("online", "offline"),
    "grpo.scale_rewards": ("group", "batch", "none"),
    "grpo.loss_type": ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"),
    "grpo.importance_sampling_level": ("token", "sequence"),
    "optim.lr_scheduler": ("constant", "linear", "cosine"),
    "distributed.strategy": ("fsdp", "ddp", "none"),
    "distributed.backend": ("auto", "nccl", "gloo"),
}


# ---------------------------------------------------------------- (de)serialisation


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


_SCI_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert one YAML value against a type annotation; raise UserError naming the key."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except UserError as e:
                errors.append(e)
        if len(errors) == 1:  # already names the key (or the list item)
            raise errors[0]
        raise UserError(f"{value!r} is not a valid value", where=key)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise UserError(f"expected a list, got {value!r}", where=key)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"expected true or false, got {value!r}", where=key)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise UserError(f"expected an integer, got {value!r}", where=key)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _SCI_FLOAT.fullmatch(value.strip()):  # YAML 1.1 reads 1e-5 as a string
            return float(value)
        raise UserError(f"expected a number, got {value!r}", where=key)
    if tp is str:
        if isinstance(value, str):
            return value
        raise UserError(f"expected a string, got {value!r}", where=key)
    raise TypeError(f"unsupported config type {tp} for {key}")


def _unknown_key(key: str, valid: list[str], prefix: str) -> UserError:
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{prefix}{near[0]}'?" if near else f"; valid keys: {', '.join(valid)}"
    return UserError(f"unknown config key '{prefix}{key}'{hint}")


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise UserError(f"expected a mapping, got {data!r}", where=prefix.rstrip(".") or "config")
    fields = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key(str(key), list(fields), prefix)
        tp = fields[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value or {}, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, tp, f"{prefix}{key}")
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    return {
        f.name: to_dict(getattr(cfg, f.name)) if dataclasses.is_dataclass(getattr(cfg, f.name)) else getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if not f.metadata.get("internal")
    }


def to_yaml(cfg) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def apply_override(data: dict, assignment: str) -> None:
    """Apply one `a.b.c=VALUE` to a nested dict; VALUE is parsed as YAML (so 0.04, true, [a, b] work)."""
    if "=" not in assignment:
        raise UserError(f"override '{assignment}' is not KEY=VALUE")
    key, raw = assignment.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"override '{key}': '{part}' is not a section")
    node[parts[-1]] = value


def _get(cfg: Config, dotted: str) -> Any:
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def validate(cfg: Config) -> None:
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise UserError(f"'{value}' is not one of {', '.join(allowed)}", where=key)
    positive = ["max_steps", "grpo.num_generations", "grpo.prompts_per_step", "grpo.micro_batch_size",
                "grpo.max_completion_length", "grpo.num_iterations", "dpo.batch_size", "dpo.micro_batch_size",
                "dpo.max_length", "data.max_prompt_length", "log.logging_steps", "eval.batch_size"]
    for key in positive:
        value = _get(cfg, key)
        if value < 1:
            raise UserError(f"must be >= 1, got {value}", where=key)
    # values the training code would otherwise crash on (division by zero, NaN sampling, optimizer checks)
    for key in ("grpo.beta", "grpo.epsilon", "grpo.top_k", "optim.lr", "eval.eval_steps"):
        if _get(cfg, key) < 0:
            raise UserError(f"must be >= 0, got {_get(cfg, key)}", where=key)
    if not cfg.grpo.temperature > 0:
        raise UserError(f"must be > 0, got {cfg.grpo.temperature}", where="grpo.temperature")
    if not 0 < cfg.grpo.top_p <= 1:
        raise UserError(f"must be in (0, 1], got {cfg.grpo.top_p}", where="grpo.top_p")
    if cfg.eval.max_new_tokens is not None and cfg.eval.max_new_tokens < 1:
        raise UserError(f"must be >= 1 (or null), got {cfg.eval.max_new_tokens}", where="eval.max_new_tokens")
    if cfg.grpo.loss_type == "cispo" and cfg.grpo.epsilon_high is None:
        raise UserError("cispo needs epsilon_high, the cap on the importance ratio (e.g. 5.0)",
                        where="grpo.epsilon_high")
    if len(cfg.data.reward_range) != 2 or cfg.data.reward_range[0] > cfg.data.reward_range[1]:
        raise UserError(f"expected [low, high], got {cfg.data.reward_range}", where="data.reward_range")
    online = cfg.algorithm == "grpo" and cfg.grpo.rollout == "online"
    if not cfg.grpo.reward_funcs and (online or cfg.data.eval and not cfg.eval.reward_funcs):
        raise UserError("no reward function: list at least one", where="grpo.reward_funcs")
    if online and cfg.grpo.num_generations < 2:
        raise UserError("GRPO needs at least 2 generations per prompt", where="grpo.num_generations")
    if cfg.grpo.reward_weights is not None and len(cfg.grpo.reward_weights) != len(cfg.grpo.reward_funcs):
        raise UserError(f"{len(cfg.grpo.reward_weights)} weights for {len(cfg.grpo.reward_funcs)} reward functions",
                        where="grpo.reward_weights")
    if not cfg.data.train:
        raise UserError("no training data: set data.train", where="data.train")
    if cfg.save_steps < 0:
        raise UserError("must be >= 0", where="save_steps")
    if not cfg.distributed.timeout_seconds > 0:
        raise UserError(f"must be > 0, got {cfg.distributed.timeout_seconds}", where="distributed.timeout_seconds")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    data: dict = {}
    config_dir = "."
    if path is not None:
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except OSError as e:
            raise UserError(f"cannot read config: {e.strerror}", where=str(path)) from None
        except yaml.YAMLError as e:
            raise UserError(f"invalid YAML: {str(e).splitlines()[0]}", where=str(path)) from None
        config_dir = str(path.parent)
    for assignment in overrides:
        apply_override(data, assignment)
    cfg = from_dict(Config, data)
    cfg.config_dir = config_dir
    cfg.model.name_or_path = resolve_local(cfg.model.name_or_path, config_dir)
    cfg.data.train = resolve_local(cfg.data.train, config_dir)
    if cfg.data.eval:
        cfg.data.eval = resolve_local(cfg.data.eval, config_dir)
    cfg.grpo.reward_funcs = [resolve_reward_file(s, config_dir) for s in cfg.grpo.reward_funcs]
    if cfg.eval.reward_funcs:
        cfg.eval.reward_funcs = [resolve_reward_file(s, config_dir) for s in cfg.eval.reward_funcs]
    validate(cfg)
    return cfg


def resolve_reward_file(spec: str, config_dir: str) -> str:
    """`file.py:function` with a relative path is read beside the config file; make it absolute so the
    resolved config (OUTPUT_DIR/config.yaml) still finds the file when loaded from another folder."""
    target, _, attr = spec.rpartition(":")
    if not target or not (target.endswith(".py") or "/" in target or "\\" in target):
        return spec  # a builtin name or an importable module
    path = Path(target).expanduser()
    return spec if path.is_absolute() else f"{(Path(config_dir) / path).resolve()}:{attr}"


def resolve_local(path: str, config_dir: str) -> str:
    """A relative local path that does not exist from the working directory but does beside the
    config file is taken from there (so `preftune train examples/grpo.yaml` works from anywhere)."""
    if not path or "://" in path or Path(path).is_absolute() or Path(path).exists():
        return path
    beside = Path(config_dir) / path
    return str(beside) if beside.exists() or any(ch in path for ch in "*?[") else path
