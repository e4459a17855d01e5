"""TRL's and PEFT's config objects read as preftune config: a TRL 1.16 `GRPOConfig`, `DPOConfig`,
`KTOConfig` or `SFTConfig` (each a `transformers.TrainingArguments`) and a `peft.LoraConfig`.

A field maps to the preftune key whose declared peer names it (`knob(peer="TRL learning_rate")`,
`peer="peft r"`), or is translated here where the meaning differs (batch sizes, precision,
strategies). Every field is read at its value on the object, TRL's defaults included, so the run is
configured as TRL would run it. A field preftune cannot honour at its value is a UserError; one it
has no use for is listed as ignored. Nothing here imports trl, transformers or peft: objects are
read by attribute, so `import preftune` stays light.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import os
import re
import typing
from typing import Any

from preftune.config.fields import keys
from preftune.config.schema import Config
from preftune.errors import UserError

ALGORITHMS = {"GRPOConfig": "grpo", "DPOConfig": "dpo", "KTOConfig": "kto", "SFTConfig": "sft"}
# the algorithm sections: only the run's own takes TRL names
SECTIONS = {"grpo", "dpo", "kto", "sft"}
# fields with no counterpart that change what TRL trains, when set to anything but their default
UNSUPPORTED = {
    "fp16": "float16 training; use bf16 (model.dtype: bfloat16)",
    "deepspeed": "DeepSpeed; preftune shards with FSDP2 under torchrun (docs/distributed.md)",
    "push_to_hub": "no model hub here; final/ is a Hugging Face folder to push yourself",
    "load_best_model_at_end": "preftune keeps the last model; `preftune eval` gates a checkpoint",
    "lr_scheduler_kwargs": "scheduler options; optim.lr_scheduler is constant, linear or cosine",
    "min_p": "min-p sampling", "repetition_penalty": "a repetition penalty",
    "generation_kwargs": "extra sampling options",
    "sync_ref_model": "reference-model syncing (TR-DPO)", "entropy_coef": "an entropy bonus",
    "use_adaptive_entropy": "an entropy bonus", "top_entropy_quantile": "entropy masking",
    "off_policy_mask_threshold": "off-policy sequence masking",
    "multi_objective_aggregation": "rewards are summed with grpo.reward_weights, then normalised",
    "num_generations_eval": "evaluation is greedy, or eval.num_samples "
                            "sampled completions per prompt",
    "f_divergence_type": "DPO with another f-divergence", "use_weighting": "WPO weighting",
    "assistant_only_loss": "SFT trains the last assistant turn", "ld_alpha": "LD-DPO",
}
ALWAYS = {"per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
          "steps_per_generation",
          "max_steps", "num_train_epochs", "output_dir"}  # translated below whatever their value
REASONS = {"use_cpu": "preftune trains on CUDA when there is a GPU, else on the CPU",
           "use_liger_kernel": "preftune has its own forward (model.lean_forward)",
           "log_completions": "metrics.jsonl has the rewards; reward "
           "functions add columns with log_extra",
           "resume_from_checkpoint": "preftune resumes from the newest checkpoint (resume: auto)"}
LORA_KEPT = {"task_type", "peft_type", "peft_version", "inference_mode",
             "base_model_name_or_path", "revision",
             "auto_mapping"}  # peft.LoraConfig fields that do not change the adapters


def is_trl_config(obj: Any) -> bool:
    return any(
        c.__module__.split(".")[0] == "trl" and c.__name__ in ALGORITHMS for c in type(obj).__mro__
    )


def is_peft_lora(obj: Any) -> bool:
    return any(
        c.__module__.split(".")[0] == "peft" and c.__name__ == "LoraConfig"
        for c in type(obj).__mro__
    )


def _plain(v: Any) -> Any:
    """An enum as its value, a set as a sorted list: as YAML and preftune's keys hold them."""
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, (set, frozenset)):
        return sorted(v)
    return v


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return _plain(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _plain(f.default_factory())
    return None


def peers(tool: str, sections: set[str] | None = None) -> dict[str, str]:
    """{the name in `tool` (TRL, peft): the preftune key} from the keys' declared peers where the
    peer is one plain name; `sections` limits the algorithm sections searched."""
    out = {}
    for key, f, _ in keys(Config):
        section = key.split(".")[0]
        if section in SECTIONS and (sections is None or section not in sections):
            continue
        for part in (f.metadata.get("peer") or "").split(";"):
            m = re.fullmatch(rf"\s*{tool} (\w+)\s*", part)
            if m:
                out.setdefault(m[1], key)
    return out


def _put(data: dict, key: str, value: Any) -> None:
    node = data
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


class _Translation:
    """The fields of one TRL config object and what became of each: mapped (same name), renamed,
    ignored (at a value other than the default, with why); `data` is the preftune config."""

    def __init__(self, obj: Any):
        self.obj, self.kind = (
            obj,
            next(c.__name__ for c in type(obj).__mro__ if c.__name__ in ALGORITHMS),
        )
        self.algorithm = ALGORITHMS[self.kind]
        self.fields = {f.name: f for f in dataclasses.fields(obj)}
        self.reference = _reference(obj)
        self.data: dict = {"algorithm": self.algorithm}
        # (how, TRL field, preftune key or why, value)
        self.rows: list[tuple[str, str, str, Any]] = []
        self.done: set[str] = set()

    def value(self, name: str) -> Any:
        return _plain(getattr(self.obj, name, None))

    def changed(self, name: str) -> bool:
        """Set to other than TRL's default (as its __post_init__ leaves the default, when it can be
        built)."""
        if name not in self.fields:
            return False
        default = (
            _plain(getattr(self.reference, name))
            if self.reference is not None
            else _default(self.fields[name])
        )
        return self.value(name) != default

    def fail(self, name: str, message: str) -> UserError:
        return UserError(message, where=f"TRL {self.kind}.{name}")

    def set(self, name: str, key: str, value: Any) -> None:
        """TRL's `name` becomes preftune's `key` = `value`."""
        _put(self.data, key, value)
        how = "mapped" if key.rsplit(".", 1)[-1] == name else "named differently"
        self.rows.append((how, name, key, value))
        self.done.add(name)

    def ignore(self, name: str, why: str) -> None:
        self.rows.append(("ignored", name, why, self.value(name)))
        self.done.add(name)


def _reference(obj: Any) -> Any:
    """A default instance of the object's class on the same device settings, or None if it cannot be
    built."""
    try:
        return type(obj)(output_dir=obj.output_dir,
                         use_cpu=getattr(obj, "use_cpu", False), bf16=obj.bf16)
    except Exception:  # noqa: BLE001 -- then the dataclass defaults serve
        return None


def translate(obj: Any) -> tuple[dict, str]:
    """(preftune config as a nested dict, the printed table) of a TRL config object."""
    t = _Translation(obj)
    _steps(t)
    _batches(t)
    _precision_and_model(t)
    _schedule_and_logging(t)
    for name, why in UNSUPPORTED.items():
        if t.changed(name) and name not in t.done:
            raise t.fail(name, f"{t.value(name)!r} cannot be honoured: preftune has no {why}")
    names = peers("TRL", {t.algorithm})
    optional = {key for key, _, tp in keys(Config) if type(None) in typing.get_args(tp)}
    for name in t.fields:
        if name in t.done or name in ALWAYS:
            continue
        if name in names and t.value(name) is None and names[name] not in optional:
            t.ignore(name, f"None: preftune keeps its default {names[name]}")
        elif name in names:
            t.set(name, names[name], t.value(name))
        elif t.changed(name):
            t.ignore(name, REASONS.get(name, "no preftune counterpart; has no effect"))
    return t.data, table(t)


def _steps(t: _Translation) -> None:
    """max_steps (preftune counts optimiser steps, never epochs), and the save/eval/logging
    intervals (TRL's float < 1 is a share of max_steps; a strategy of "no" is 0)."""
    max_steps = t.value("max_steps")
    if max_steps is None or max_steps <= 0:
        raise t.fail("max_steps",
                     f"{max_steps}: TRL then trains num_train_epochs epochs; preftune counts "
                     "optimiser steps: set max_steps")
    t.set("max_steps", "max_steps", max_steps)
    t.set("output_dir", "output_dir", t.value("output_dir"))

    def interval(name: str, strategy: str | None, key: str, fallback: str | None = None) -> None:
        how = t.value(strategy) if strategy else "steps"
        if how == "no":
            t.set(name, key, 0)
        elif how != "steps":
            raise t.fail(strategy,
                         f"{how!r} cannot be honoured: preftune "
                         "saves, evaluates and logs every N steps")
        else:
            n = t.value(name) if t.value(name) is not None else t.value(fallback)
            t.set(name, key, math.ceil(n * max_steps) if isinstance(n, float) and n < 1 else int(n))
        if strategy:
            t.done.add(strategy)

    interval("logging_steps", None, "log.logging_steps")
    interval("save_steps", "save_strategy", "save_steps")
    interval("eval_steps", "eval_strategy", "eval.eval_steps", fallback="logging_steps")


def _batches(t: _Translation) -> None:
    """TRL's per-device sizes times gradient accumulation (and, for GRPO, its generation batch) as
    preftune's global batch per optimiser step and its micro-batch."""
    per_device, accumulation = (
        t.value("per_device_train_batch_size"),
        t.value("gradient_accumulation_steps"),
    )
    section = t.algorithm
    t.set("per_device_train_batch_size", f"{section}.micro_batch_size", per_device)
    if section != "grpo":
        world = _world(t)
        t.set("gradient_accumulation_steps", f"{section}.batch_size",
              per_device * accumulation * world)
        return
    per_generation = t.value("steps_per_generation") or accumulation
    if per_generation != accumulation:
        raise t.fail("steps_per_generation",
                     f"{per_generation} optimiser micro-steps per generation batch with "
                     f"gradient_accumulation_steps={accumulation}: preftune samples one generation "
                     "batch per optimiser step (grpo.num_iterations reuses it whole)")
    completions = t.value("generation_batch_size") or per_device * accumulation * _world(t)
    generations = t.value("num_generations")
    if completions % generations:
        raise t.fail("generation_batch_size", f"{completions} completions are not whole groups of "
                     f"num_generations={generations}")
    t.set("generation_batch_size", "grpo.prompts_per_step", completions // generations)
    t.done |= {"gradient_accumulation_steps", "steps_per_generation"}


def _world(t: _Translation) -> int:
    """The ranks TRL's per-device sizes multiply by: torchrun's WORLD_SIZE, as TRL's accelerate
    counts them."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _precision_and_model(t: _Translation) -> None:
    t.set("bf16", "model.dtype", "bfloat16" if t.value("bf16") else "float32")
    kwargs = dict(t.value("model_init_kwargs") or {})
    dtype = str(kwargs.pop("dtype", kwargs.pop("torch_dtype", "auto"))).removeprefix("torch.")
    if dtype in ("bfloat16", "float32"):
        t.set("model_init_kwargs", "model.dtype", dtype)
    elif dtype != "auto":
        raise t.fail("model_init_kwargs",
                     f"dtype {dtype!r} cannot be honoured: model.dtype is float32 or bfloat16")
    remote = bool(kwargs.pop("trust_remote_code", False) or t.value("trust_remote_code"))
    t.set("trust_remote_code", "model.trust_remote_code", remote)
    if kwargs:
        t.rows.append(("ignored", "model_init_kwargs", "preftune loads the model itself", kwargs))
    t.done.add("model_init_kwargs")
    t.set("gradient_checkpointing", "model.gradient_checkpointing",
          bool(t.value("gradient_checkpointing")))
    if "torch_compile" in t.fields:
        t.set("torch_compile", "model.compile", bool(t.value("torch_compile")))
    if t.algorithm == "sft" and t.value("loss_type") not in (None, "nll"):
        raise t.fail("loss_type",
                     f"{t.value('loss_type')!r} cannot be honoured: preftune's SFT loss is the NLL")
    if t.algorithm == "sft" and "packing" in t.fields:
        t.set("packing", "sft.packing", bool(t.value("packing") or t.value("padding_free")))
        t.done.add("padding_free")
    if t.algorithm == "grpo":
        scale = t.value("scale_rewards")
        t.set("scale_rewards", "grpo.scale_rewards",
              {True: "group", False: "none"}.get(scale, scale))
        clip_max = "vllm_importance_sampling_clip_max"
        if t.value("vllm_importance_sampling_cap") is not None:  # TRL's older name of clip_max
            clip_max = "vllm_importance_sampling_cap"
        t.set(clip_max, "grpo.vllm_importance_sampling_clip_max", t.value(clip_max))
        t.done |= {"vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap"}
    if "ddp_timeout" in t.fields:
        t.set("ddp_timeout", "distributed.timeout_seconds", float(t.value("ddp_timeout")))


def _schedule_and_logging(t: _Translation) -> None:
    schedule = t.value("lr_scheduler_type")
    known = {"linear": "linear", "cosine": "cosine", "constant": "constant",
             "constant_with_warmup": "constant"}
    if schedule not in known:
        raise t.fail("lr_scheduler_type",
                     f"{schedule!r} cannot be honoured: optim.lr_scheduler "
                     "is constant, linear or cosine (after warmup)")
    t.set("lr_scheduler_type", "optim.lr_scheduler", known[schedule])
    warmup = t.value("warmup_steps") or 0
    # Hugging Face's "constant" has no warmup; preftune's warms up when asked
    if schedule == "constant":
        t.set("warmup_steps", "optim.warmup_steps", 0)
    # transformers 5: a float below 1 is a share of max_steps
    elif isinstance(warmup, float) and warmup < 1:
        t.set("warmup_steps", "optim.warmup_ratio", warmup)
    else:
        t.set("warmup_steps", "optim.warmup_steps", int(warmup))
    optim = str(t.value("optim"))
    if not optim.startswith("adamw_torch"):
        raise t.fail("optim", f"{optim!r} cannot be honoured: preftune's optimiser is AdamW")
    t.done.add("optim")
    report = t.value("report_to")
    report = (
        []
        if report in (None, "none", ["none"])
        else [report]
        if isinstance(report, str)
        else list(report)
    )
    t.set("report_to", "log.report_to", report)
    t.set("disable_tqdm", "log.progress_bar", not t.value("disable_tqdm"))
    resume = t.value("resume_from_checkpoint")
    if resume:
        t.set("resume_from_checkpoint", "resume", "auto" if resume is True else str(resume))
    # None: preftune's resume: auto (a fresh output_dir starts fresh)
    t.done.add("resume_from_checkpoint")


def table(t: _Translation) -> str:
    """What became of the TRL config's fields, one per line: mapped, named differently, ignored."""
    lines = [f"TRL {t.kind} -> preftune config (algorithm: "
             f"{t.algorithm}); TRL's values, its defaults included:"]
    order = {"mapped": 0, "named differently": 1, "ignored": 2}
    for how, name, key, value in sorted(t.rows, key=lambda r: order[r[0]]):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        lines.append(f"  {how:<18} {name:<36} "
                     f"{'-> ' + key if how != 'ignored' else '(' + key + ')':<44} {shown}")
    rest = len(set(t.fields) - t.done - ALWAYS)
    lines.append(f"  ({rest} other fields at TRL's defaults "
                 "have no preftune counterpart and no effect)")
    return "\n".join(lines)


def lora_section(obj: Any, where: str = "peft_config") -> dict:
    """A `peft.LoraConfig` as preftune's `model.lora` section (names from the keys' `peft` peers);
    a setting preftune's LoRA cannot honour is a UserError."""
    names = peers("peft")
    section = {"enabled": True}
    for f in dataclasses.fields(obj):
        value = _plain(getattr(obj, f.name))
        if f.name in names:
            section[names[f.name].rsplit(".", 1)[-1]] = value
        elif value != _default(f) and f.name not in LORA_KEPT:
            raise UserError(f"{value!r} cannot be honoured: preftune's LoRA has r, lora_alpha, "
                            "lora_dropout and target_modules", where=f"{where}.{f.name}")
    if section.get("target_modules") is None:
        raise UserError("None lets PEFT pick by architecture; name "
                        "them, e.g. 'all-linear' or ['q_proj', 'v_proj']",
                        where=f"{where}.target_modules")
    return section
