"""Reading a config: YAML (strict), dotted KEY=VALUE overrides, relative paths, and the checks
that tie keys together. `load_config(path, overrides)` is the entry point."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import yaml

from preftune.config.deploy import check_deploy
from preftune.config.fields import check_section, check_value, from_dict, keys, to_dict
from preftune.config.redact import redact
from preftune.config.schema import TRACKERS, Config, DPOConfig, GRPOConfig, KTOConfig, SFTConfig
from preftune.config.trl import translate as trl_names
from preftune.config.trl_config import is_peft_lora, is_trl_config, lora_section, translate
from preftune.errors import UserError


def to_yaml(cfg) -> str:
    """The config as YAML, credentials redacted (config/redact.py): every copy written down."""
    return yaml.safe_dump(redact(to_dict(cfg)), sort_keys=False)


def check_key(key: str, value) -> None:
    """`value` against the declaration of the dotted config `key`; UserError naming the key."""
    f = next((f for k, f, _ in keys(Config) if k == key), None)
    if f is None:
        raise KeyError(key)
    check_value(key, f, value)


def check_report_to(names: list[str]) -> None:
    """Every name of log.report_to is a tracker (TRACKERS) whose package is installed."""
    for name in names:
        if name not in TRACKERS:
            raise UserError(f"'{name}' is not one of {', '.join(TRACKERS)}", where="log.report_to")
        module, extra = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise UserError(f"{name} is not installed: pip install 'preftune[{extra}]'",
                            where="log.report_to")
        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        if name == "mlflow" and (not uri or uri.startswith("sqlite:")) and not all(
                importlib.util.find_spec(m) for m in ("sqlalchemy", "alembic")):
            raise UserError("mlflow's default store (a sqlite file) needs sqlalchemy "
                            "and alembic: pip install 'preftune[mlflow]', or set "
                            "MLFLOW_TRACKING_URI to a tracking server",
                            where="log.report_to")


def check_vllm(rollout: str) -> None:
    if rollout != "online":
        raise UserError("vLLM samples online rollouts; offline groups "
                        "come from the traces: set grpo.use_vllm=false",
                        where="grpo.use_vllm")


def check_replay(cfg: Config) -> None:
    """Routing replay needs the experts the own sampler records in single-turn online rollouts."""
    g = cfg.grpo
    why = (
        "offline groups were not sampled by this model" if g.rollout != "online"
        else "vLLM's routed experts are not read yet: sample with grpo.use_vllm=false"
        if g.use_vllm
        else "a tool loop's later turns reuse cached prompts whose routes are not kept"
        if g.tools or g.environment_factory
        else "a rollout_func's completions come without routes" if g.rollout_func
        else "it needs preftune's own module: set model.lean_forward=true"
        if not cfg.model.lean_forward
        else None
    )
    if why:
        raise UserError(f"routing replay needs the own sampler's routes: {why}",
                        where="grpo.routing_replay")


def check_tools(cfg: Config) -> None:
    """Tools run in online rollouts, one engine per rank (`rollout/agent.py`)."""
    if cfg.grpo.rollout != "online":
        raise UserError("tools and environments act in online "
                        "rollouts; offline groups come from the traces",
                        where="grpo.tools")
    if cfg.grpo.rollout_func:
        raise UserError("a rollout_func samples the completions "
                        "itself: run its tools there, or drop it",
                        where="grpo.rollout_func")
    if cfg.grpo.use_vllm and cfg.grpo.vllm_tensor_parallel_size > 1:
        raise UserError("a tool loop runs each rank's rows on its own engine: set "
                        "grpo.vllm_tensor_parallel_size=1",
                        where="grpo.vllm_tensor_parallel_size")


def apply_override(data: dict, assignment: str) -> None:
    """Apply one `a.b.c=VALUE` to a nested dict; VALUE is parsed as YAML (so 0.04, true, [a, b]
    work)."""
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




def validate(cfg: Config) -> None:
    """Every key against its declaration, then the rules that tie keys together."""
    check_section(cfg, "")
    if cfg.grpo.loss_type == "cispo" and cfg.grpo.epsilon_high is None:
        raise UserError("cispo needs epsilon_high, the cap on the importance ratio (e.g. 5.0)",
                        where="grpo.epsilon_high")
    if len(cfg.data.reward_range) != 2 or cfg.data.reward_range[0] > cfg.data.reward_range[1]:
        raise UserError(f"expected [low, high], got {cfg.data.reward_range}",
                        where="data.reward_range")
    online = cfg.algorithm == "grpo" and cfg.grpo.rollout == "online"
    if not cfg.grpo.reward_funcs and not cfg.grpo.environment_factory and (
            # an environment may score by get_reward
            online or cfg.data.eval and not cfg.eval.reward_funcs):
        raise UserError("no reward function: list at least one", where="grpo.reward_funcs")
    if cfg.algorithm == "grpo" and (cfg.grpo.tools or cfg.grpo.environment_factory):
        check_tools(cfg)
    if cfg.algorithm == "grpo" and cfg.grpo.rollout_func and (cfg.grpo.rollout != "online" or (
            cfg.grpo.use_vllm and cfg.grpo.vllm_tensor_parallel_size > 1)):
        raise UserError("a rollout_func samples online rollouts, each rank on its own engine",
                        where="grpo.rollout_func")
    if online and cfg.grpo.num_generations < 2:
        raise UserError("GRPO needs at least 2 generations per prompt",
                        where="grpo.num_generations")
    if cfg.grpo.reward_weights is not None and len(cfg.grpo.reward_weights) != len(
        cfg.grpo.reward_funcs
    ):
        raise UserError(f"{len(cfg.grpo.reward_weights)} weights for "
                        f"{len(cfg.grpo.reward_funcs)} reward functions",
                        where="grpo.reward_weights")
    # one response could be both chosen and rejected
    if cfg.data.chosen_min < cfg.data.rejected_max:
        raise UserError(f"must be >= data.rejected_max ({cfg.data.rejected_max}), got "
                        f"{cfg.data.chosen_min}",
                        where="data.chosen_min")
    if cfg.grpo.overlong_buffer_len > cfg.grpo.max_completion_length:
        raise UserError("must be <= grpo.max_completion_length "
                        f"({cfg.grpo.max_completion_length}), "
                        f"got {cfg.grpo.overlong_buffer_len}", where="grpo.overlong_buffer_len")
    if not cfg.data.train:
        raise UserError("no training data: set data.train", where="data.train")
    dpo_types = [cfg.dpo.loss_type] if isinstance(cfg.dpo.loss_type, str) else cfg.dpo.loss_type
    if cfg.algorithm == "dpo" and cfg.dpo.use_weighting and {"aot",
                                                             "aot_unpaired"} & set(dpo_types):
        raise UserError("WPO weighting is per pair; aot and aot_unpaired sort terms across pairs",
                        where="dpo.use_weighting")
    if cfg.algorithm == "grpo" and cfg.grpo.routing_replay:
        check_replay(cfg)
    if cfg.algorithm == "grpo" and cfg.grpo.use_vllm:
        check_vllm(cfg.grpo.rollout)
        if (cfg.grpo.loss_type == "vespo" and cfg.grpo.vllm_importance_sampling_correction
            and not cfg.grpo.vllm_importance_sampling_mode.startswith("token_")):
            raise UserError("vespo folds the engine's per-token "
                            "weights into its own: use token_truncate "
                            "or token_mask", where="grpo.vllm_importance_sampling_mode")

    # DDP keeps a whole replica per device and steps it there: no host-resident shards to step
    if cfg.distributed.cpu_offload and cfg.distributed.strategy == "ddp":
        raise UserError("CPU offload is FSDP2's (CPUOffloadPolicy): set "
                        "distributed.strategy=fsdp, or cpu_offload=false",
                        where="distributed.cpu_offload")
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
                raise UserError(f"{parent} is a file, so {p} cannot be a folder",
                                where="output_dir")
            break


def read_source(source) -> tuple[dict, str]:
    """(nested dict, folder relative paths are read from) of a YAML file, a dict, a Config, one
    algorithm's section (`GRPOConfig(...)`: that algorithm with those keys) or a TRL config object
    (translated field by field, config/trl_config.py, with its table printed)."""
    if source is None:
        return {}, "."
    if isinstance(source, Config):
        return _copy_tree(to_dict(source)), source.config_dir
    if isinstance(source, dict):
        data = _copy_tree(source)
        lora = (
            (data.get("model") or {}).get("lora") if isinstance(data.get("model"), dict) else None
        )
        if is_peft_lora(lora):  # a peft.LoraConfig as the model.lora section
            data["model"]["lora"] = lora_section(lora, "model.lora")
        return data, "."
    if is_trl_config(source):
        data, report = translate(source)
        print(report)
        return data, "."
    algorithm = {GRPOConfig: "grpo", DPOConfig: "dpo", KTOConfig: "kto",
                 SFTConfig: "sft"}.get(type(source))
    if algorithm is not None:
        return {"algorithm": algorithm, algorithm: _copy_tree(to_dict(source))}, "."
    if dataclasses.is_dataclass(source) and type(source).__module__ == "preftune.config.schema":
        name = type(source).__name__
        raise UserError(f"a {name} is one section of a config; pass preftune.Config(...) holding "
                        "it, a dict, or a YAML path", where="config")
    if not isinstance(source, (str, os.PathLike)):
        raise UserError("expected a YAML path, a dict, a preftune.Config or a TRL "
                        "GRPOConfig/DPOConfig/KTOConfig/SFTConfig, "
                        f"got a {type(source).__name__}", where="config")
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
        raise UserError(f"expected a mapping of config keys, got a {type(data).__name__}",
                        where=str(path))
    return data, str(path.parent)


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, except that a key given twice in one mapping is an error: YAML
    keeps the last one silently, so `lr: 1e-5` further up would be ignored without a word."""


def _mapping_without_duplicates(loader, node, deep=False):
    first: dict = {}
    for key_node, _ in node.value:
        # `<<: *base`: merged keys may be overridden here
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            seen = key in first
        except TypeError:  # an unhashable key: construct_mapping says what is wrong with it
            break
        if seen:
            raise yaml.constructor.ConstructorError(
                None, None,
                f"duplicate key {key!r} (first on line {first[key] + 1})", key_node.start_mark)
        first[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                              _mapping_without_duplicates)


def _copy_tree(d: dict) -> dict:
    """The nested dicts and lists copied, their leaves (which may be data tables or functions)
    shared."""
    copy = lambda v: _copy_tree(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v  # noqa: E731
    return {k: copy(v) for k, v in d.items()}


def load_config(source: str | Path | dict | Config | None, overrides: list[str] = ()) -> Config:
    """A validated Config from a YAML file, a nested dict or a Config, plus dotted KEY=VALUE
    overrides."""
    data, config_dir = read_source(source)
    for assignment in overrides:
        apply_override(data, assignment)
    return build_config(data, config_dir)


def build_config(data: dict, config_dir: str = ".") -> Config:
    """Check, resolve relative paths against `config_dir`, and validate a nested config dict. TRL's
    flat names and values are read as preftune's (config/trl.py)."""
    cfg = from_dict(Config, trl_names(data))
    cfg.config_dir = config_dir
    cfg.model.name_or_path = resolve_local(cfg.model.name_or_path, config_dir)
    cfg.data.train = resolve_local(cfg.data.train, config_dir)
    if cfg.data.eval:
        cfg.data.eval = resolve_local(cfg.data.eval, config_dir)
    if cfg.data.tools:
        cfg.data.tools = resolve_local(cfg.data.tools, config_dir)
    cfg.grpo.reward_funcs = [resolve_reward_file(s, config_dir) for s in cfg.grpo.reward_funcs]
    if cfg.eval.reward_funcs:
        cfg.eval.reward_funcs = [resolve_reward_file(s, config_dir) for s in cfg.eval.reward_funcs]
    validate(cfg)
    return cfg


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error as one line with its 1-based line and column."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return (
        f"line {mark.line + 1} column {mark.column + 1}: {problem}" if mark is not None else problem
    )


def resolve_reward_file(spec: str, config_dir: str) -> str:
    """`file.py:function` with a relative path is read beside the config file; make it absolute so
    the resolved config (OUTPUT_DIR/config.yaml) still finds the file when loaded from another
    folder. So is a reward-model folder given as a path (`./rm`, `models/rm`) that exists there and
    not here."""
    target, _, attr = spec.rpartition(":")
    if not target and ("/" in spec or "\\" in spec or spec.startswith(".")):
        local = resolve_local(spec, config_dir)
        return str(Path(local).resolve()) if Path(local).is_dir() else spec
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
