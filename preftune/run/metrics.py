"""metrics.jsonl (one JSON object per logged step), a progress bar, and the trackers of
log.report_to."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from preftune.atomic import atomic_write
from preftune.run.startup import STARTUP_KEYS

log = logging.getLogger("preftune")

# the only fields a resumed run may change
TIMING_KEYS = ("step_time", "tokens_per_second", "vllm/weight_push_s", *STARTUP_KEYS)


def _clean(v):
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None  # JSON has no NaN; null marks "not measured"
    return v


def truncate_after(path: Path, step: int) -> None:
    """Keep only records with step <= `step` (a resumed run rewrites what came after its
    checkpoint)."""
    if not path.exists():
        return
    keep = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] <= step
    ]
    atomic_write(path, "".join(line + "\n" for line in keep))


def read_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl (training steps and evaluations, in order)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class Window:
    """The steps since the last record, logged as TRL (and the Hugging Face Trainer) log them with
    logging_steps > 1: each metric's mean over the window's steps that measured it (NaN/None
    left out), `learning_rate` and `grad_norm` the last step's, `num_tokens` the running total."""

    LAST = ("learning_rate", "grad_norm", "num_tokens")

    def __init__(self, state: dict | None = None):
        state = state or {}
        self.sums: dict[str, float] = dict(state.get("sums", {}))
        self.counts: dict[str, int] = dict(state.get("counts", {}))
        self.last: dict = dict(state.get("last", {}))

    def add(self, metrics: dict) -> None:
        for k, v in metrics.items():
            if k in self.LAST or not isinstance(v, (int, float)) or isinstance(v, bool):
                self.last[k] = v
            elif not math.isnan(v):
                self.sums[k] = self.sums.get(k, 0.0) + v
                self.counts[k] = self.counts.get(k, 0) + 1
            else:
                self.counts.setdefault(k, 0)

    def take(self) -> dict:
        """The window's record (in the order the metrics first came), and a new empty window."""
        out = {
            k: self.sums[k] / self.counts[k] if self.counts[k] else math.nan for k in self.counts
        }
        out |= self.last
        self.sums, self.counts, self.last = {}, {}, {}
        return out

    def state_dict(self) -> dict:
        """Plain data for the checkpoint: a resume mid-window logs the same record."""
        return {"sums": dict(self.sums), "counts": dict(self.counts), "last": dict(self.last)}


class MetricsLog:
    """metrics.jsonl, the progress bar and the trackers of log.report_to (run/loggers.py)."""

    def __init__(self, out_dir: Path, *, total_steps: int, start_step: int,
                 progress: bool, trackers=()):
        self.path = out_dir / "metrics.jsonl"
        truncate_after(self.path, start_step)
        self.file = open(self.path, "a")
        self.bar = None
        if progress:
            from tqdm.auto import tqdm  # a widget in notebooks, text in a terminal

            self.bar = tqdm(total=total_steps, initial=max(start_step, 0),
                            desc="train", dynamic_ncols=True)
        self.trackers = list(trackers)
        self.failing: set[str] = set()
        self.closed = False

    def log(self, step: int, metrics: dict, *, advance: bool = False) -> dict:
        """Write one record everywhere; returns it as written to metrics.jsonl."""
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        for tracker in self.trackers:
            try:
                tracker.log(step, metrics)
            except Exception as e:  # noqa: BLE001 -- a tracker outage must not end a training run
                if tracker.key not in self.failing:  # metrics.jsonl keeps every record; warn once
                    log.warning("logging to %s failed (metrics.jsonl has every record; later "
                                "failures are not reported): %s", tracker.key, e)
                self.failing.add(tracker.key)
        if self.bar is not None:
            if advance:
                self.bar.update(1)
            show = {k: metrics[k] for k in ("reward", "loss", "kl", "eval/reward") if k in metrics}
            if show:
                self.bar.set_postfix({k: f"{v:.3f}" for k, v in show.items() if v is not None},
                                     refresh=False)
        return record

    def state_dict(self) -> dict:
        """What a resume needs to continue the same tracker runs (their ids)."""
        return {t.key: t.state() for t in self.trackers if t.state() is not None}

    def close(self, status: str = "finished") -> None:
        """status: finished | preempted | failed (how trackers mark the run). Closing twice is a
        no-op."""
        if self.closed:
            return
        self.closed = True
        self.file.close()
        if self.bar is not None:
            self.bar.close()
        for tracker in self.trackers:
            try:
                tracker.close(status)
            except Exception as e:  # noqa: BLE001 -- a tracker failing to close must not hide the run's outcome
                log.warning("closing %s failed: %s", tracker.key, e)
