"""What the run loop asks of an algorithm, declared once: `Task`. GRPOTask, DPOTask, KTOTask and
SFTTask implement it; the loop (`run/loop.py`) holds the one table of algorithms."""
from __future__ import annotations

from typing import Any, Callable, Protocol


class Task(Protocol):
    """An algorithm's data order and its step; the loop owns the optimizer, the schedule,
    logging, checkpoints and the stop flag. A task builds everything at construction and writes
    nothing."""

    # what the data became (OUTPUT_DIR/data_report.json, written by the loop once setup succeeded)
    data_report: dict
    # the engine that samples evaluation's completions as training's (online GRPO), else None
    engine: Any
    # the tools and environments held-out tasks run through (GRPO with tools), else None
    agent: Any

    def prepare(self, model) -> None:
        """What the task computes from the initial weights (DPO's and KTO's reference log-probs);
        also after a restore, whose weights are the initial ones again."""

    def step(self, model, step: int, stop) -> dict:
        """One optimiser step's forward and backward (the loop steps the optimizer) -> its
        metrics. `stop.check()` between micro-batches abandons the step on preemption."""

    def evaluator(self) -> Callable[[Any, int], dict] | None:
        """The task's own held-out evaluation (DPO's pairs), or None for the run's default (held-out
        prompts, `evaluation/evaluate.py`)."""

    def state_dict(self) -> dict:
        """Everything the next step reads (data position, pending batch) for a checkpoint."""

    def load_state_dict(self, state: dict) -> None:
        ...
