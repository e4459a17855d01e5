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

from preftune.deploy.settings import DeployConfig, check_deploy
from preftune.errors import UserError
from preftune.run.loggers import check_report_to


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
    lean_forward: bool = True  # preftune's own decoder forward where it replays the model (preftune/decoder.py)
    cuda_graphs: bool = False  # on a GPU, replay the lean decode step as a CUDA graph (rollout/sampler.py)
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
    precompute_ref_logps: bool = True  # false: hold a frozen reference and run it on each batch (TRL's default)
    max_length: int = 512  # prompt + response tokens
    batch_size: int = 16  # pairs per optimiser step
    micro_batch_size: int = 16


@dataclass
class SFTConfig:
    min_reward: float = 0.7  # labeled traces: train on responses with final_reward >= this (rejection sampling)
    max_length: int = 512  # prompt + completion tokens
    batch_size: int = 16  # examples per optimiser step
    micro_batch_size: int = 16  # examples per forward/backward
    packing: bool = True  # several examples per row (attention kept within each) when it saves positions


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
    num_samples: int = 1  # k > 1: also k completions per prompt at grpo.temperature (pass@k, mean@k)
    split: float = 0.0  # without data.eval: hold out this fraction of the training prompts (by prompt hash)


@dataclass
class GateConfig:
    min_reward: float | None = None  # eval/reward of the checkpoint must reach this
    min_improvement: float | None = None  # lower confidence bound of (checkpoint - baseline) must exceed this
    max_length_growth: float | None = None  # mean completion length ratio checkpoint / baseline at most this
    confidence: float = 0.95  # bootstrap confidence level of the improvement's lower bound
    bootstrap_samples: int = 2000
    registry: str | None = None  # local path or fsspec URL of a JSONL model registry; a pass appends a record


@dataclass
class LogConfig:
    logging_steps: int = 1
    report_to: list[str] = field(default_factory=list)  # any of tensorboard, wandb, mlflow
    progress_bar: bool = True
    # W&B project / MLflow experiment (None: WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME, else "preftune")
    project: str | None = None
    run_name: str | None = None  # W&B / MLflow run name (None: the output_dir folder name)


@dataclass
class DistributedConfig:
    """Data parallel under torchrun (see train/distributed.py); ignored in one plain process."""
    strategy: str = "fsdp"  # fsdp | ddp | none
    backend: str = "auto"  # auto (nccl on CUDA, else gloo) | nccl | gloo
    timeout_seconds: float = 600.0  # a collective waiting longer (a dead rank) fails the run
    reshard_after_forward: bool = True  # FSDP2: free gathered parameters after each block's forward


@dataclass
class Config:
    algorithm: str = "grpo"  # grpo | dpo | sft
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
    sft: SFTConfig = field(default_factory=SFTConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    log: LogConfig = field(default_factory=LogConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    deploy: DeployConfig = field(default_factory=DeployConfig)  # preftune render / cost
    config_dir: str = field(default=".", metadata={"internal": True})


CHOICES = {
    "algorithm": ("grpo", "dpo", "sft"),
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
    "deploy.scheduler": ("volcano", "kubernetes"),
    "deploy.capacity_type": ("spot", "on-demand"),
    "deploy.image_pull_policy": ("Always", "IfNotPresent", "Never"),
}

# The valid range of every numeric key, as an interval: "[" / "]" include the bound, "(" / ")"
# exclude it, "inf" is unbounded. Checked at load time (a null optional value is not checked; a
# list is checked item by item). A new numeric key needs a row here (tests/test_config.py checks).
BOUNDS = {
    "max_steps": "[1, inf)",
    "save_steps": "[0, inf)",  # 0 = no intermediate checkpoints
    "seed": "[0, 4294967295]",  # numpy's seed range
    "save_total_limit": "[1, inf)",
    "preemption_grace_seconds": "[0, inf)",
    "model.lora.r": "[1, inf)",
    "model.lora.alpha": "[1, inf)",
    "model.lora.dropout": "[0, 1)",
    "data.reward_range": "[-inf, inf]",
    "data.min_reward_threshold": "(-inf, inf)",
    "data.max_prompt_length": "[1, inf)",
    "data.chosen_min": "(-inf, inf)",
    "data.rejected_max": "(-inf, inf)",
    "data.max_pairs_per_prompt": "[1, inf)",
    "data.min_margin": "[0, inf)",
    "grpo.prompts_per_step": "[1, inf)",
    "grpo.num_generations": "[1, inf)",
    "grpo.micro_batch_size": "[1, inf)",
    "grpo.max_completion_length": "[1, inf)",
    "grpo.temperature": "(0, inf)",
    "grpo.top_p": "(0, 1]",
    "grpo.top_k": "[0, inf)",
    "grpo.reward_weights": "(-inf, inf)",
    "grpo.overlong_buffer_len": "[0, inf)",
    "grpo.beta": "[0, inf)",
    "grpo.epsilon": "[0, 1)",  # the ratio is clipped to [1 - epsilon, ...]
    "grpo.epsilon_high": "[0, inf)",
    "grpo.delta": "(1, inf)",  # a cap on the ratio above 1 (INTELLECT-2 uses 4)
    "grpo.num_iterations": "[1, inf)",
    "grpo.max_resample_rounds": "[0, inf)",
    "dpo.loss_weights": "[0, inf)",
    "dpo.beta": "(0, inf)",
    "dpo.label_smoothing": "[0, 0.5]",
    "dpo.max_length": "[2, inf)",  # at least one prompt and one response token
    "dpo.batch_size": "[1, inf)",
    "dpo.micro_batch_size": "[1, inf)",
    "optim.lr": "[0, inf)",
    "optim.weight_decay": "[0, inf)",
    "optim.adam_beta1": "[0, 1)",
    "optim.adam_beta2": "[0, 1)",
    "optim.adam_epsilon": "(0, inf)",
    "optim.warmup_steps": "[0, inf)",
    "optim.warmup_ratio": "[0, 1]",
    "optim.max_grad_norm": "[0, inf)",  # 0 = no clipping
    "eval.eval_steps": "[0, inf)",  # 0 = only before the first and after the last step
    "eval.max_new_tokens": "[1, inf)",
    "eval.batch_size": "[1, inf)",
    "eval.num_samples": "[1, inf)",
    "eval.split": "[0, 1)",
    "sft.min_reward": "(-inf, inf)",
    "sft.max_length": "[2, inf)",  # at least one prompt and one completion token
    "sft.batch_size": "[1, inf)",
    "sft.micro_batch_size": "[1, inf)",
    "gate.min_reward": "(-inf, inf)",
    "gate.min_improvement": "(-inf, inf)",
    "gate.max_length_growth": "(0, inf)",
    "gate.confidence": "(0, 1)",
    "gate.bootstrap_samples": "[1, inf)",
    "log.logging_steps": "[1, inf)",
    "distributed.timeout_seconds": "(0, inf)",
    "deploy.nodes": "[1, inf)",
    "deploy.gpus_per_node": "[1, inf)",
    "deploy.efa_interfaces": "[1, inf)",
    "deploy.max_retry": "[0, inf)",
    "deploy.termination_grace_seconds": "[1, inf)",
    "deploy.max_gpus": "[1, inf)",  # and at least the job's GPUs (deploy/settings.check_deploy)
}


@dataclass(frozen=True)
class Interval:
    lo: float
    hi: float
    lo_closed: bool
    hi_closed: bool
    text: str

    @classmethod
    def parse(cls, text: str) -> "Interval":
        m = re.fullmatch(r"\s*([\[(])\s*([^,\s]+)\s*,\s*([^\s\])]+)\s*([\])])\s*", text)
        if not m:
            raise ValueError(f"bad interval {text!r}; expected e.g. '[0, 1)'")
        return cls(float(m[2]), float(m[3]), m[1] == "[", m[4] == "]", text.strip())

    def __contains__(self, v: float) -> bool:  # NaN is in no interval
        above = v >= self.lo if self.lo_closed else v > self.lo
        below = v <= self.hi if self.hi_closed else v < self.hi
        return bool(above and below)


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
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise UserError(f"expected a mapping, got {value!r}", where=key)
        return {_coerce(k, key_tp, key): _coerce(v, value_tp, f"{key}.{k}") for k, v in value.items()}
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
    out = {}
    for f in dataclasses.fields(cfg):
        if not f.metadata.get("internal"):
            value = getattr(cfg, f.name)
            out[f.name] = to_dict(value) if dataclasses.is_dataclass(value) else value
    return out


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


def check_key(key: str, value: Any) -> None:
    """`value` against CHOICES and BOUNDS for `key` (a dotted config key); UserError naming the key."""
    if key in CHOICES and value not in CHOICES[key]:
        raise UserError(f"'{value}' is not one of {', '.join(CHOICES[key])}", where=key)
    if key in BOUNDS and value is not None:
        interval = Interval.parse(BOUNDS[key])
        for i, v in enumerate(value) if isinstance(value, list) else [(None, value)]:
            if v not in interval:
                where = key if i is None else f"{key}[{i}]"
                raise UserError(f"must be in {interval.text}, got {v}", where=where)


def check_section(section, prefix: str) -> None:
    """Every key of one config section (a dataclass, e.g. `DataConfig` built from CLI flags)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            check_section(value, f"{prefix}{f.name}.")
        elif not f.metadata.get("internal"):
            check_key(f"{prefix}{f.name}", value)


def validate(cfg: Config) -> None:
    check_section(cfg, "")
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
    if cfg.data.chosen_min < cfg.data.rejected_max:  # one response could be both chosen and rejected
        raise UserError(f"must be >= data.rejected_max ({cfg.data.rejected_max}), got {cfg.data.chosen_min}",
                        where="data.chosen_min")
    if cfg.grpo.overlong_buffer_len > cfg.grpo.max_completion_length:
        raise UserError(f"must be <= grpo.max_completion_length ({cfg.grpo.max_completion_length}), "
                        f"got {cfg.grpo.overlong_buffer_len}", where="grpo.overlong_buffer_len")
    if not cfg.data.train:
        raise UserError("no training data: set data.train", where="data.train")

    check_report_to(cfg.log.report_to)
    check_deploy(cfg.deploy, cfg.preemption_grace_seconds, cfg.checkpoint_uri)
    check_output_dir(cfg.output_dir)


def check_output_dir(output_dir: str) -> None:
    """output_dir must be a folder or not exist yet, and must not lie under a file."""
    p = Path(output_dir).expanduser().absolute()
    if p.exists() and not p.is_dir():
        raise UserError(f"{p} is a file, not a folder", where="output_dir")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{parent} is a file, so {p} cannot be a folder", where="output_dir")
            break


def read_source(source: str | Path | dict | Config | None) -> tuple[dict, str]:
    """(nested dict, folder relative paths are read from) of a YAML file, a dict or a Config."""
    if source is None:
        return {}, "."
    if isinstance(source, Config):
        return _copy_tree(to_dict(source)), source.config_dir
    if isinstance(source, dict):
        return _copy_tree(source), "."
    path = Path(source)
    try:
        data = yaml.load(path.read_text(), Loader=_StrictLoader) or {}
    except OSError as e:
        raise UserError(f"cannot read config: {e.strerror}", where=str(path)) from None
    except UnicodeDecodeError as e:
        raise UserError(f"not UTF-8 text (byte {e.start})", where=str(path)) from None
    except yaml.YAMLError as e:
        raise UserError(f"invalid YAML: {yaml_problem(e)}", where=str(path)) from None
    if not isinstance(data, dict):
        raise UserError(f"expected a mapping of config keys, got a {type(data).__name__}", where=str(path))
    return data, str(path.parent)


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, except that a key given twice in one mapping is an error: YAML
    keeps the last one silently, so `lr: 1e-5` further up would be ignored without a word."""


def _mapping_without_duplicates(loader, node, deep=False):
    first: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: merged keys may be overridden here
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            seen = key in first
        except TypeError:  # an unhashable key: construct_mapping says what is wrong with it
            break
        if seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {first[key] + 1})", key_node.start_mark)
        first[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def _copy_tree(d: dict) -> dict:
    """The nested dicts and lists copied, their leaves (which may be data tables or functions) shared."""
    copy = lambda v: _copy_tree(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v  # noqa: E731
    return {k: copy(v) for k, v in d.items()}


def load_config(source: str | Path | dict | Config | None, overrides: list[str] = ()) -> Config:
    """A validated Config from a YAML file, a nested dict or a Config, plus dotted KEY=VALUE overrides."""
    data, config_dir = read_source(source)
    for assignment in overrides:
        apply_override(data, assignment)
    return build_config(data, config_dir)


def build_config(data: dict, config_dir: str = ".") -> Config:
    """Check, resolve relative paths against `config_dir`, and validate a nested config dict."""
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


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error as one line with its 1-based line and column."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"line {mark.line + 1} column {mark.column + 1}: {problem}" if mark is not None else problem


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
