"""Loading reward functions (built-ins, Python functions, reward-model folders) and scoring
completions with them (TRL's reward contract).

A reward function is called as

    f(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_extra=...,
      log_metric=..., **columns) -> list[float | None]

exactly like TRL 1.16's `GRPOTrainer._calculate_rewards`, so a TRL reward function runs unchanged.
`None` means "not applicable to this row" and becomes NaN in the per-function table.
"""
from __future__ import annotations

import asyncio
import difflib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import numbers
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from preftune.data.messages import is_messages
from preftune.errors import UserError, one_line
from preftune.rewards import CALLABLE_PREFIX
from preftune.rewards.builtin import BUILTINS
from preftune.rewards.model import is_model_folder, load_reward_model

# Dataset columns TRL never forwards (they are passed positionally-named instead).
_DROPPED_COLUMNS = ("prompt", "completion", "completion_ids")
_RESERVED_KWARGS = ("prompts", "completions", "completion_ids", "trainer_state",
                    "log_extra", "log_metric")


@dataclass
class RewardState:
    """Stand-in for TRL's `TrainerState`, passed as `trainer_state` for progress-dependent
    shaping."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


@dataclass
class RewardLog:
    """What reward functions log through TRL's `log_metric(name, value)` and `log_extra(column,
    values)`: per metric the sum and count of its values (TRL logs their mean), per column its
    values in order."""

    metrics: dict[str, list[float]] = field(default_factory=dict)  # name -> [sum, count]
    columns: dict[str, list] = field(default_factory=dict)

    def metric(self, name: str, value: float) -> None:
        if not isinstance(value,
                          numbers.Real) and not (isinstance(value,
                                                            torch.Tensor) and value.numel() == 1):
            raise UserError(f"log_metric({name!r}, ...) needs one number, got "
                            f"{type(value).__name__}")
        total = self.metrics.setdefault(str(name), [0.0, 0])
        total[0] += float(value)
        total[1] += 1

    def extra(self, column: str, values: Sequence[Any]) -> None:
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise UserError(f"log_extra({column!r}, ...) needs a list of values, got "
                            f"{type(values).__name__}")
        self.columns.setdefault(str(column), []).extend(_plain(v) for v in values)

    def add(self, other: "RewardLog") -> "RewardLog":
        """This log and `other` (a later round, another rank) together."""
        for name, (s, n) in other.metrics.items():
            total = self.metrics.setdefault(name, [0.0, 0])
            total[0] += s
            total[1] += n
        for column, values in other.columns.items():
            self.columns.setdefault(column, []).extend(values)
        return self

    def record(self) -> dict:
        """The metrics.jsonl entries: each metric's mean under its own name (as TRL logs it), each
        column's values as `extra/<column>`."""
        return {**{k: s / n for k, (s, n) in self.metrics.items() if n},
                **{f"extra/{k}": v for k, v in self.columns.items()}}


def _plain(v: Any) -> Any:
    """A logged value as JSON holds it: numbers, strings, booleans, None; anything else as its
    text."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    return str(v)


@dataclass
class RewardResult:
    per_func: torch.Tensor  # (N, F) float32, NaN where a function returned None
    # (N,) weighted nansum over functions, NaN where every function returned None
    total: torch.Tensor
    names: list[str]  # F metric names, unique
    # what the functions logged (log_metric, log_extra)
    log: RewardLog = field(default_factory=RewardLog)


# ---------------------------------------------------------------------------------------------
# Python functions handed to preftune.train(reward_funcs=[...])

CALLABLES: dict[str, Callable] = {}  # spec -> function, while train() runs


def qualified_name(func: Callable) -> str:
    """`module.qualname` of a function (of the wrapped one for a functools.partial, of the class for
    a callable object): how config.yaml records it and how a resume recognises it."""
    while isinstance(func, functools.partial):
        func = func.func
    target = func if hasattr(func, "__qualname__") else type(func)
    return f"{getattr(target, '__module__', None) or '?'}.{target.__qualname__}"


def register_callables(funcs: Sequence[Any]) -> list[str]:
    """Replace the callables in `funcs` by `callable:<module>.<qualname>` specs (registered for
    `load_reward_function`); strings pass through. Two different functions with one name get `#2`,
    `#3`."""
    specs, named = [], {}
    for func in funcs:
        if isinstance(func, str) or not callable(func):
            specs.append(func)
            continue
        base = spec = f"{CALLABLE_PREFIX}{qualified_name(func)}"
        n = 1
        while named.get(spec, func) is not func:
            n += 1
            spec = f"{base}#{n}"
        named[spec] = CALLABLES[spec] = func
        specs.append(spec)
    return specs


def check_callables(specs: Sequence[str] | None, key: str) -> None:
    """Every `callable:` spec names a function handed to this preftune.train() call."""
    for spec in specs or ():
        if isinstance(spec, str) and spec.startswith(CALLABLE_PREFIX) and spec not in CALLABLES:
            raise UserError(f"'{spec}' is a Python function (or class) that was "
                            "handed to preftune.train(); pass the same one "
                            "again (a command line or a config file cannot)", where=key)


# ---------------------------------------------------------------------------------------------
# loading


def load_reward_function(spec: str, *, base_dir: str | Path = ".", device: Any = "cpu",
                         reward_model_batch_size: int = 64, **builtin_options: Any) -> Callable:
    """Resolve `spec` to a reward function.

    `spec` is a builtin name (see `preftune.rewards.builtin.BUILTINS`), a local Hugging Face
    sequence-classification folder (a reward model, `rewards/model.py`: loaded once on `device`,
    scoring `reward_model_batch_size` completions per forward), `module:function` (an importable
    module; `base_dir` is searched first), or `path/to/file.py:function` (relative to `base_dir`,
    the config file's folder, or absolute). `builtin_options` configure builtins (e.g.
    `max_completion_length`, `overlong_buffer_len`) and are ignored for custom functions.
    """
    where = f"reward '{spec}'"
    spec = str(spec).strip()
    if not spec:
        raise UserError("empty reward spec", where=where)
    if spec.startswith(CALLABLE_PREFIX):
        check_callables([spec], where)
        return CALLABLES[spec]
    if ":" not in spec and spec not in BUILTINS:
        folder = is_model_folder(spec, base_dir)
        if folder is not None:
            return load_reward_model(folder, device=device,
                                     batch_size=reward_model_batch_size, where=where)
        if "/" in spec or "\\" in spec or spec.startswith("."):
            raise UserError(f"no such reward-model folder: {spec} "
                            f"(looked in {Path.cwd()} and {base_dir})", where=where)
    if ":" not in spec:
        if spec not in BUILTINS:
            near = difflib.get_close_matches(spec, list(BUILTINS), n=1)
            hint = f"did you mean '{near[0]}'? " if near else ""
            raise UserError(
                f"unknown built-in reward; {hint}built-ins: {', '.join(sorted(BUILTINS))}; custom "
                "rewards are 'module:function' or 'file.py:function'",
                where=where,
            )
        return BUILTINS[spec](builtin_options)
    return load_callable(spec, base_dir, where)


def load_callable(spec: str, base_dir: str | Path, where: str) -> Callable:
    """`callable:<module>.<qualname>` (handed to preftune.train), `module:name` or `file.py:name`
    (relative to `base_dir`) -> the callable: a reward function, a tool, an environment class."""
    spec = str(spec).strip()
    if spec.startswith(CALLABLE_PREFIX):
        check_callables([spec], where)
        return CALLABLES[spec]
    # the last colon keeps a Windows drive letter in the path
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise UserError("expected 'module:function' or 'file.py:function'", where=where)
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _load_file(target, Path(base_dir), where)
    else:
        module = _import_module(target, Path(base_dir), where)
    return _get_callable(module, attr, where)


def _import_module(name: str, base_dir: Path, where: str):
    # A module sitting next to the config should import without the user editing PYTHONPATH.
    with _on_sys_path(base_dir):
        try:
            return importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 -- any import-time failure is the user's module
            raise UserError(
                f"cannot import module '{name}': {one_line(exc, with_type=True)}", where=where
            ) from exc


def _load_file(target: str, base_dir: Path, where: str):
    path = Path(target).expanduser()
    path = path if path.is_absolute() else base_dir / path
    path = path.resolve()
    if not path.is_file():
        raise UserError(f"file not found: {path}", where=where)
    # A unique, stable module name per file so two `rewards.py` in different folders don't collide,
    # and registering it in sys.modules lets pickling and dataclasses in the file work.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    mod_name = f"preftune_user_rewards.{path.stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"cannot load {path} as a Python module", where=where)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    with _on_sys_path(path.parent):  # so the file can import its sibling modules
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001
            del sys.modules[mod_name]
            raise UserError(
                f"error importing {path}: {one_line(exc, with_type=True)}", where=where
            ) from exc
    return module


class _on_sys_path:
    def __init__(self, folder: Path):
        self.folder = str(Path(folder).resolve())

    def __enter__(self):
        self.added = self.folder not in sys.path
        if self.added:
            sys.path.insert(0, self.folder)

    def __exit__(self, *exc):
        if self.added and self.folder in sys.path:
            sys.path.remove(self.folder)


def _get_callable(module, attr: str, where: str) -> Callable:
    if not hasattr(module, attr):
        names = [
            n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None))
        ]
        near = difflib.get_close_matches(attr, names, n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise UserError(f"module '{module.__name__}' has no attribute '{attr}'{hint}", where=where)
    func = getattr(module, attr)
    if not callable(func):
        raise UserError(f"'{attr}' is a {type(func).__name__}, not a callable", where=where)
    return func


def reward_name(func: Callable) -> str:
    """Metric name of a reward function (`rewards/<name>/mean`): its `__name__` like TRL; a
    `functools.partial` without its own `__name__` uses the wrapped function's; a callable object
    without one uses its class name."""
    while isinstance(func, functools.partial) and "__name__" not in getattr(func, "__dict__", {}):
        func = func.func
    return getattr(func, "__name__", None) or type(func).__name__


def _unique(names: list[str]) -> list[str]:
    # Two rewards with one name would overwrite each other's metrics: suffix the later ones.
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out


# ---------------------------------------------------------------------------------------------
# scoring


def as_completions(prompts: Sequence[Any], texts: Sequence[str]) -> list[Any]:
    """Completions in the form TRL passes to rewards: the decoded string for text prompts, or
    `[{"role": "assistant", "content": text}]` when the prompts are chat messages."""
    if prompts and is_messages(prompts[0]):
        return [[{"role": "assistant", "content": t}] for t in texts]
    return list(texts)


def _reward_kwargs(columns: Mapping[str, Sequence[Any]], n: int,
                   extra_kwargs: Mapping[str, Any] | None, log: RewardLog) -> dict:
    kwargs: dict[str, Any] = {}
    for key, values in columns.items():
        if key in _DROPPED_COLUMNS:
            continue
        if key in _RESERVED_KWARGS:
            raise UserError(f"dataset column '{key}' clashes with "
                            "a reward-function argument; rename it")
        if len(values) != n:
            raise ValueError(f"column '{key}' has {len(values)} values for {n} completions")
        kwargs[key] = list(values)
    # TRL passes these on every call: what the functions log comes back in RewardResult.log
    kwargs.update(trainer_state=RewardState(), log_extra=log.extra, log_metric=log.metric)
    kwargs.update(extra_kwargs or {})
    return kwargs


def _call_reward(func: Callable, name: str, args: dict) -> Any:
    try:
        out = func(**args)
        if inspect.isawaitable(out):  # async rewards (e.g. an LLM judge), run to completion
            out = asyncio.run(_await(out))
        return out
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 -- a failing reward is reported as the user's error
        raise UserError(f"raised {one_line(exc, with_type=True)}",
                        where=f"reward '{name}'") from exc


async def _await(awaitable):
    return await awaitable


def _to_column(out: Any, name: str, n: int) -> list[float]:
    """Validate one function's output and turn it into n floats (NaN for None)."""
    where = f"reward '{name}'"
    # 1-D arrays work in TRL too
    if isinstance(out, torch.Tensor) or type(out).__module__ == "numpy":
        out = out.tolist() if getattr(out, "ndim", None) == 1 else out
    if not isinstance(out, (list, tuple)):
        raise UserError(f"returned a {type(out).__name__}, expected a list of {n} floats",
                        where=where)
    if len(out) != n:
        raise UserError(f"returned {len(out)} values, expected {n} (one per completion)",
                        where=where)
    column = []
    for row, value in enumerate(out):
        if value is None:
            column.append(float("nan"))
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, numbers.Real):
            raise UserError(f"returned a non-numeric value {value!r} "
                            f"at row {row}; use None to skip a row", where=where)
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise UserError(f"returned non-finite value {value} "
                            f"at row {row}; use None to skip a row", where=where)
        column.append(value)
    return column


def _weights_tensor(weights: Sequence[float] | None, num_funcs: int) -> torch.Tensor:
    if weights is None:
        return torch.ones(num_funcs, dtype=torch.float32)
    weights = list(weights)
    if len(weights) != num_funcs:
        raise UserError(f"got {len(weights)} reward weights for {num_funcs} reward functions",
                        where="reward_weights")
    w = torch.tensor([float(x) for x in weights], dtype=torch.float32)  # (F,)
    if not torch.isfinite(w).all():
        raise UserError(f"reward weights must be finite, got {weights}", where="reward_weights")
    return w


def compute_rewards(
    funcs: Sequence[Callable],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence[Any]],
    *,
    weights: Sequence[float] | None = None,
    extra_kwargs: Mapping[str, Any] | None = None,
) -> RewardResult:
    """Score N completions with F reward functions.

    per_func[i, k] = f_k(...)[i] (NaN for None); total[i] = sum_k w_k * per_func[i, k] over the
    non-NaN entries (TRL's weighted `nansum`), and NaN when every function returned None for row i
    (TRL 1.16 marks such rows unscorable). `columns` hold one value per completion; `extra_kwargs`
    (e.g. `trainer_state`) override the defaults passed to every function. What the functions log
    with `log_metric` / `log_extra` is returned in `log`.
    """
    n = len(completions)
    if not funcs:
        raise ValueError("compute_rewards needs at least one reward function")
    if len(prompts) != n or len(completion_ids) != n:
        raise ValueError(f"got {len(prompts)} prompts, {n} completions, "
                         f"{len(completion_ids)} completion_ids")
    w = _weights_tensor(weights, len(funcs))  # (F,)
    log = RewardLog()
    kwargs = _reward_kwargs(columns, n, extra_kwargs, log)
    names = _unique([reward_name(f) for f in funcs])
    args = dict(prompts=list(prompts), completions=list(completions),
                completion_ids=list(completion_ids), **kwargs)
    cols = [_to_column(_call_reward(f, name, args), name, n) for f, name in zip(funcs, names)]
    # (N, F)
    per_func = torch.tensor(cols, dtype=torch.float32).reshape(len(funcs), n).T.contiguous()
    total = (per_func * w.unsqueeze(0)).nansum(dim=1)  # (N,)
    total[torch.isnan(per_func).all(dim=1)] = torch.nan
    return RewardResult(per_func=per_func, total=total, names=names, log=log)


def load_reward_funcs(specs: Sequence[str], grpo, base_dir: str | Path = ".",
                      device: Any = "cpu") -> list[Callable]:
    """Every reward function of a run; `grpo` (a `GRPOConfig`) configures the length-based builtins
    and the reward models' batch size; reward models run on `device` (the policy's)."""
    return [load_reward_function(s, base_dir=base_dir, device=device,
                                 reward_model_batch_size=grpo.reward_model_batch_size,
                                 max_completion_length=grpo.max_completion_length,
                                 overlong_buffer_len=grpo.overlong_buffer_len) for s in specs]
