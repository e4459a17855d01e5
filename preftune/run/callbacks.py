"""A run's callbacks: preftune's functions `cb(step, record)` and transformers `TrainerCallback`s.

A function is called after each record written to metrics.jsonl (training steps and evaluations);
returning True stops the run at that step boundary (a checkpoint is saved, final/ written). A
`TrainerCallback` gets the Trainer's events with `args`, `state` and `control`, in the Trainer's
order: on_train_begin; each step on_step_begin, on_step_end, on_log (a logged step), on_log and
on_evaluate (an evaluation), on_save (a checkpoint); on_train_end after final/.
`control.should_training_stop` stops the run as a function's True does; the other `should_*` flags
are not read (preftune logs, evaluates and saves on its own schedule). Callbacks run on rank 0.
"""
from __future__ import annotations

from typing import Any

from preftune.errors import UserError


def is_trainer_callback(obj: Any) -> bool:
    """A transformers TrainerCallback (instance or class), recognised without importing
    transformers."""
    cls = obj if isinstance(obj, type) else type(obj)
    return any(
        c.__name__ == "TrainerCallback" and c.__module__.startswith("transformers")
        for c in cls.__mro__
    )


def check_callbacks(callbacks: Any) -> list:
    """The callbacks as a list: functions and TrainerCallback instances (a TrainerCallback class is
    instantiated, as the Trainer does). Anything else is a UserError now, before anything loads."""
    if callbacks is None:
        return []
    if callable(callbacks) and not isinstance(callbacks, type) or is_trainer_callback(callbacks):
        callbacks = [callbacks]
    out = []
    for i, cb in enumerate(callbacks):
        if is_trainer_callback(cb):
            out.append(cb() if isinstance(cb, type) else cb)
        elif callable(cb) and not isinstance(cb, type):
            out.append(cb)
        else:
            raise UserError(f"a {type(cb).__name__} is neither a function cb(step, metrics) nor a "
                            "transformers.TrainerCallback", where=f"callbacks[{i}]")
    return out


class Callbacks:
    """The events of one run for its callbacks (`check_callbacks` first). `stop` turns True when one
    asked to stop. `args`: the TrainingArguments handed to TrainerCallbacks (a TRL config passed as
    the config, else one made from the preftune config)."""

    def __init__(self, callbacks, cfg, args: Any = None):
        callbacks = check_callbacks(callbacks)
        self.functions = [c for c in callbacks if not is_trainer_callback(c)]
        self.trainer = [c for c in callbacks if is_trainer_callback(c)]
        self.stop = False
        # model, processing_class, optimizer: what the Trainer passes as keywords
        self.objects: dict = {}
        if self.trainer:
            from transformers import TrainerControl, TrainerState

            self.args = args if args is not None else training_arguments(cfg)
            self.state = TrainerState(max_steps=cfg.max_steps, logging_steps=cfg.log.logging_steps,
                                      eval_steps=cfg.eval.eval_steps, save_steps=cfg.save_steps,
                                      is_local_process_zero=True, is_world_process_zero=True)
            self.control = TrainerControl()

    def bind(self, **objects: Any) -> None:
        self.objects = objects

    def event(self, name: str, step: int, **kwargs: Any) -> None:
        """Call `name` (on_step_end, ...) on every TrainerCallback with the state at `step`."""
        if not self.trainer:
            return
        self.state.global_step = step
        if name == "on_step_begin" and hasattr(self.control, "_new_step"):
            self.control._new_step()  # the Trainer clears the per-step flags here
        for cb in self.trainer:
            out = getattr(cb, name)(self.args, self.state, self.control, **self.objects, **kwargs)
            if out is not None:  # the Trainer keeps a returned control
                self.control = out
        if self.control.should_training_stop:
            self.stop = True

    def log(self, step: int, record: dict, *, evaluation: bool) -> None:
        """A record written to metrics.jsonl (without its step): functions, then on_log (and
        on_evaluate)."""
        for cb in self.functions:
            if cb(step, dict(record)) is True:
                self.stop = True
        if self.trainer:
            self.state.log_history.append({**record, "step": step})
            self.event("on_log", step, logs=dict(record))
            if evaluation:
                self.event("on_evaluate", step, metrics=dict(record))


def training_arguments(cfg):
    """transformers TrainingArguments carrying the preftune config's values under TRL's names."""
    from transformers import TrainingArguments

    save = (
        {"save_strategy": "steps", "save_steps": cfg.save_steps}
        if cfg.save_steps
        else {"save_strategy": "no"}
    )
    return TrainingArguments(output_dir=cfg.output_dir, max_steps=cfg.max_steps,
                             logging_steps=cfg.log.logging_steps,
                             learning_rate=cfg.optim.lr, seed=cfg.seed, report_to="none",
                             run_name=cfg.log.run_name, **save)
