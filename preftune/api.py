"""`preftune.train()`: what `preftune train` runs, from Python, with in-memory rewards, data and
callbacks.

The command line is a thin layer over this function: it is called with the YAML path and the
overrides, and maps `UserError` to exit 78 and `Preempted` to exit 75. Importing this module
imports neither torch nor transformers; `train()` does.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from preftune.config import Config, apply_override, build_config, read_source
from preftune.config.trl_config import is_peft_lora, is_trl_config, lora_section
from preftune.data import in_memory as memory
from preftune.errors import UserError
from preftune.run.callbacks import Callbacks, check_callbacks
from preftune.run.metrics import read_records

# A callback: cb(step, record) after each logged training step and each evaluation, with the record
# as written to metrics.jsonl (without "step"). Returning True stops the run at this step boundary.
# A transformers TrainerCallback gets the Trainer's events instead (run/callbacks.py).
Callback = Callable[[int, dict], Any]


@dataclass
class TrainResult:
    """What a run produced. `metrics` is the last training record, `eval` every evaluation record
    (step 0, every eval_steps, the last step), both as in metrics.jsonl."""

    model_path: Path  # OUTPUT_DIR/final, a Hugging Face model folder
    output_dir: Path
    step: int  # the last optimiser step
    metrics: dict = field(default_factory=dict)
    eval: list[dict] = field(default_factory=list)
    # a callback stopped the run before max_steps (a checkpoint was saved)
    stopped_early: bool = False

    @property
    def metrics_path(self) -> Path:
        return self.output_dir / "metrics.jsonl"


def train(config: Any, *, overrides: Sequence[str] | Mapping[str, Any] = (),
          reward_funcs: Sequence[str | Callable] | None = None,
          train_data: Any = None, eval_data: Any = None,
          callbacks: Sequence[Any] | None = None, peft_config: Any = None, model: Any = None,
          processing_class: Any = None, tools: Sequence[str | Callable] | None = None,
          environment_factory: str | Callable | Mapping[str, str | Callable] | None = None,
          rollout_func: str | Callable | None = None
          ) -> TrainResult:
    """Train as `preftune train CONFIG KEY=VALUE...` does, and return what it produced.

    config: a YAML path, a nested dict, a `Config`, one algorithm's section
    (`preftune.DPOConfig(...)`) or a TRL `GRPOConfig`/`DPOConfig`/`KTOConfig`/`SFTConfig`
    (translated, its table printed). overrides: `["grpo.beta=0.04", ...]` as on the command line, or
    `{"grpo.beta": 0.04}`. reward_funcs: TRL-contract functions and/or the names the config accepts;
    replaces `grpo.reward_funcs`. train_data / eval_data: a `datasets.Dataset`, a pandas DataFrame
    or a list of dicts in place of `data.train` / `data.eval`. callbacks: functions `cb(step,
    metrics)` and transformers `TrainerCallback`s. peft_config: a `peft.LoraConfig` (or a
    `model.lora` mapping). model: a model folder, or a loaded transformers model (written once to
    OUTPUT_DIR/base_model; its tokenizer is `processing_class`, else read from the folder it was
    loaded from). Raises `UserError` for what the command line reports with exit 78 and `Preempted`
    after a signal-triggered checkpoint. tools / environment_factory / rollout_func (online GRPO,
    TRL's contracts, docs/agents.md): functions the policy may call, a class of which each rollout
    gets an instance (or a mapping of names to classes, picked per row by its `environment`
    column), a function that samples the completions itself; replace `grpo.tools` /
    `grpo.environment_factory` / `grpo.rollout_func`.
    """
    # torch: imported by the call, not by `import preftune.api`
    from preftune.rewards import functions as registry

    # a wrong object fails now, not after the model has loaded
    callbacks = check_callbacks(callbacks)
    data, config_dir = read_source(config)
    if peft_config is not None:
        lora = lora_section(peft_config) if is_peft_lora(peft_config) else peft_config
        if not isinstance(lora, Mapping):
            raise UserError("expected a peft.LoraConfig or a mapping of model.lora keys, got a "
                            f"{type(lora).__name__}", where="peft_config")
        data.setdefault("model", {})["lora"] = {"enabled": True, **lora}
    if model is not None:
        data.setdefault("model", {})["name_or_path"] = model
    _apply_overrides(data, overrides)
    with _scoped(memory.TABLES, registry.CALLABLES):
        _with_agent(data, tools, environment_factory, rollout_func)
        cfg = _with_objects(data, config_dir, reward_funcs, train_data, eval_data, processing_class)
        return run(
            cfg, callbacks=Callbacks(callbacks, cfg, args=config if is_trl_config(config) else None)
        )


def run(cfg: Config, *, callbacks: Any = ()) -> TrainResult:
    """Run a validated config; functions and tables it names must be registered (see `train`)."""
    from preftune.rewards.functions import check_callables
    from preftune.model.load import quiet_transformers
    from preftune.run.loop import train as train_loop

    # before anything is loaded or written: a run's config.yaml names objects only Python can hand
    # over
    memory.check_registered(cfg.data.train, "data.train")
    memory.check_registered(cfg.data.eval, "data.eval")
    check_callables(cfg.grpo.reward_funcs, "grpo.reward_funcs")
    check_callables(cfg.eval.reward_funcs, "eval.reward_funcs")
    check_callables(cfg.grpo.tools, "grpo.tools")
    for key in ("environment_factory", "rollout_func"):
        check_callables([getattr(cfg.grpo, key)] if getattr(cfg.grpo, key) else [], f"grpo.{key}")
    with quiet_transformers():
        final = train_loop(cfg, callbacks=callbacks)
    trained, evals = [], []
    for r in read_records(final.parent / "metrics.jsonl"):
        (evals if any(k.startswith("eval/") for k in r) else trained).append(r)
    step = trained[-1]["step"] if trained else 0
    return TrainResult(model_path=final, output_dir=final.parent, step=step,
                       metrics=trained[-1] if trained else {}, eval=evals,
                       stopped_early=step < cfg.max_steps)


def _apply_overrides(data: dict, overrides: Sequence[str] | Mapping[str, Any]) -> None:
    if isinstance(overrides, str):
        raise UserError("overrides must be a list of KEY=VALUE strings "
                        f"or a dict, got the string {overrides!r}")
    if isinstance(overrides, Mapping):
        for key, value in overrides.items():
            node = data
            for part in str(key).split(".")[:-1]:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise UserError(f"override '{key}': '{part}' is not a section")
            node[str(key).split(".")[-1]] = value
        return
    for assignment in overrides:
        apply_override(data, assignment)


def _with_agent(data: dict, tools, environment_factory, rollout_func) -> None:
    """Tools, an environment class and a rollout function handed over as Python objects, named in
    the config as reward functions are (`callable:<module>.<qualname>`)."""
    from preftune.rewards.functions import register_callables

    grpo = data.setdefault("grpo", {})
    if tools is not None:
        grpo["tools"] = [tools] if isinstance(tools, str) or callable(tools) else list(tools)
    if environment_factory is not None:
        grpo["environment_factory"] = environment_factory
    if isinstance(grpo.get("tools"), list):
        grpo["tools"] = register_callables(grpo["tools"])
    if rollout_func is not None:
        grpo["rollout_func"] = rollout_func
    for key in ("environment_factory", "rollout_func"):
        if callable(grpo.get(key)):
            grpo[key] = register_callables([grpo[key]])[0]
    if isinstance(grpo.get("environment_factory"), Mapping):  # a class per `environment` value
        grpo["environment_factory"] = {
            name: register_callables([f])[0] if callable(f) else f
            for name, f in grpo["environment_factory"].items()}
    if not grpo:
        del data["grpo"]


def _with_objects(data: dict, config_dir: str, reward_funcs, train_data, eval_data,
                  processing_class=None) -> Config:
    """The config with Python objects (given as arguments or as config values) replaced by the names
    that stand for them: `callable:<module>.<qualname>`, `in-memory:<name>@<hash>`, and a loaded
    model by the folder it is written to."""
    from preftune.rewards.functions import register_callables

    section = data.get("model")
    if isinstance(section, dict) and not isinstance(section.get("name_or_path", ""), (str, Path)):
        from preftune.model.objects import write_model_object

        out = Path(str(data.get("output_dir") or Config().output_dir))
        section["name_or_path"] = write_model_object(section["name_or_path"], processing_class, out)
    elif isinstance(section, dict) and isinstance(section.get("name_or_path"), Path):
        section["name_or_path"] = str(section["name_or_path"])

    if reward_funcs is not None:
        if isinstance(reward_funcs, str) or callable(reward_funcs):
            reward_funcs = [reward_funcs]
        data.setdefault("grpo", {})["reward_funcs"] = list(reward_funcs)
    for section, key in (("grpo", "reward_funcs"), ("eval", "reward_funcs")):
        specs = (data.get(section) or {}).get(key)
        if isinstance(specs, list):
            data[section][key] = register_callables(specs)
    for key, obj in (("train", train_data), ("eval", eval_data)):
        if obj is not None:
            data.setdefault("data", {})[key] = obj
        value = (data.get("data") or {}).get(key)
        # a table given as the config value
        if value is not None and not isinstance(value, (str, Path)):
            data["data"][key] = memory.register(value, f"{key}_data")
        elif isinstance(value, Path):
            data["data"][key] = str(value)
    return build_config(data, config_dir)


@contextmanager
def _scoped(*registries: dict):
    """Forget what gets registered in `registries` inside the block: the names stand for objects of
    this call only."""
    before = [set(r) for r in registries]
    try:
        yield
    finally:
        for registry, keys in zip(registries, before):
            for key in set(registry) - keys:
                del registry[key]


