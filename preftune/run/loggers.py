"""Experiment trackers behind `log.report_to`: TensorBoard, Weights & Biases, MLflow.

Each gets the records of metrics.jsonl under the same names (eval records included), and W&B and
MLflow get the resolved config as run parameters, credentials redacted. Their packages are optional
extras, checked when the config is validated (exit 78 naming the extra). A tracker's run id is part
of the checkpoint (`state()`), so a resumed run continues the same W&B / MLflow run instead of
starting a new one. No package is imported until a tracker is built.

A tracker that cannot be reached at the start (an outage: no connection, a timeout, a 5xx) is not
a config error: with `log.on_tracker_outage: fail` the run exits 69 (retryable), with `local` it
goes on with metrics.jsonl (and the other trackers) and keeps the unreachable one's run id for the
next resume. Errors while logging never stop a run (run/metrics.py).
"""
from __future__ import annotations

import logging
import math
import os
import re
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from preftune.errors import Unavailable, UserError, one_line

log = logging.getLogger("preftune")

DEFAULT_PROJECT = "preftune"


def scalars(metrics: dict) -> dict[str, float]:
    """The finite numbers of a record (trackers have no null; jsonl keeps those as null)."""
    return {k: v for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """{"grpo.beta": "0.04", ...}: the nested config as dotted keys and string values."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat_params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


class TrackerOutage(Exception):
    """A tracker's server could not be reached (not a config error)."""


_OUTAGE = re.compile(
    r"Max retries exceeded|Failed to establish|Connection "
    r"(refused|reset|aborted)|timed out|"
    r"Temporary failure in name resolution|Name or service not known|\b50[234]\b",
    re.I,
)


def is_outage(e: BaseException) -> bool:
    """No connection, a timeout or a server error (5xx), through the exception's chain."""
    while e is not None:
        if isinstance(e, (ConnectionError, TimeoutError)) or _OUTAGE.search(str(e)) \
                or getattr(e, "error_code", None) in ("TEMPORARILY_UNAVAILABLE",
                                                      "SERVICE_UNDER_MAINTENANCE"):
            return True
        e = e.__cause__ or e.__context__
    return False


class Unreached:
    """Stands in for a tracker that was unreachable at the start (log.on_tracker_outage: local):
    logs nothing and keeps the run id of the checkpoint for the next resume."""

    def __init__(self, key: str, state: dict | None):
        self.key, self._state = key, state

    def log(self, step: int, metrics: dict) -> None:
        pass

    def state(self) -> dict | None:
        return self._state

    def close(self, status: str) -> None:
        pass


def build_trackers(names: list[str], out_dir: Path, *, config: dict,
                   project: str | None, run_name: str | None,
                   start_step: int, state: dict | None, on_outage: str = "fail") -> list:
    """The trackers named in log.report_to, continuing the runs recorded in `state` (from a
    checkpoint)."""
    state = state or {}
    name = run_name or Path(out_dir).resolve().name
    built = []
    try:
        for tracker in dict.fromkeys(names):
            try:
                if tracker == "tensorboard":
                    built.append(TensorBoard(out_dir, start_step))
                elif tracker == "wandb":
                    built.append(WandB(out_dir, config, project, name, state.get("wandb")))
                elif tracker == "mlflow":
                    built.append(MLflow(config, project, name, state.get("mlflow")))
            except TrackerOutage as e:
                if on_outage != "local":
                    raise Unavailable(
                        f"{e} (log.on_tracker_outage: local goes on without it)"
                    ) from None
                log.warning("%s: going on with metrics.jsonl only (log.on_tracker_outage: local)",
                            e)
                built.append(Unreached(tracker, state.get(tracker)))
    except BaseException:
        for t in built:  # the ones already open must not outlive the failed start
            t.close("failed")
        raise
    return built


class TensorBoard:
    key = "tensorboard"

    def __init__(self, out_dir: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run rewrites the events after its checkpoint instead of duplicating them
        self.writer = SummaryWriter(str(Path(out_dir) / "tensorboard"),
                                    purge_step=start_step + 1 if start_step > 0 else None)

    def log(self, step: int, metrics: dict) -> None:
        for k, v in scalars(metrics).items():
            self.writer.add_scalar(k, v, step)

    def state(self) -> dict | None:
        return None

    def close(self, status: str) -> None:
        self.writer.close()


class WandB:
    """One W&B run per output_dir lifetime: its id is saved in each checkpoint and reused on resume.

    `reinit="create_new"` leaves a run the user has open in the same process alone; wandb's
    exception hook is put back on close so nothing of it outlives the run.
    """

    key = "wandb"

    def __init__(self, out_dir: Path, config: dict, project: str | None,
                 name: str, state: dict | None):
        import wandb

        self.excepthook = sys.excepthook
        run_id = (state or {}).get("id")  # None: W&B makes a new one
        try:
            self.run = wandb.init(
                project=project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                name=name,
                id=run_id,
                resume="allow",
                config=config,
                reinit="create_new",
                dir=os.environ.get("WANDB_DIR") or str(out_dir),
            )
        except wandb.errors.Error as e:
            sys.excepthook = self.excepthook
            if isinstance(e, wandb.errors.CommError) or is_outage(e):
                raise TrackerOutage(f"wandb is unreachable: {one_line(e)}") from None
            raise UserError(f"wandb: {one_line(e)}", where="log.report_to") from None
        log.info("wandb run %s%s", self.run.id, " (resumed)" if state else "")

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(scalars(metrics), step=step)

    def state(self) -> dict:
        return {"id": self.run.id}

    def close(self, status: str) -> None:
        if status == "preempted":
            self.run.mark_preempting()
        self.run.finish(exit_code={"finished": 0, "preempted": 75}.get(status, 1))
        sys.excepthook = self.excepthook


_MLFLOW_BAD = re.compile(r"[^\w\-. /:]")  # characters MLflow refuses in a metric name


class MLflow:
    """An MLflow run through `MlflowClient` (no global active run that could leak out of train());
    the tracking store is MLflow's own setting: MLFLOW_TRACKING_URI, else MLflow's default, a
    sqlite file (./mlflow.db; the `mlflow` extra brings sqlalchemy and alembic for it).

    MLflow's local file store keeps each metric in a file named by its key, so it cannot hold both
    a name and a longer one under it (`sampled/pass@4` and `sampled/pass@4/accuracy`): there `/` is
    written as `.`; other stores get the names as they are.
    """

    key = "mlflow"
    STATUS = {"finished": "FINISHED", "preempted": "KILLED"}

    def __init__(self, config: dict, project: str | None, name: str, state: dict | None):
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        try:
            self.client = MlflowClient()
            self.file_store = urlparse(self.client.tracking_uri).scheme in ("", "file")
            self.run_id = self._resume((state or {}).get("run_id"))
            if self.run_id is None:
                self.run_id = self._create(
                    project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT, name
                )
            self._log_params(flat_params(config))
        except Exception as e:  # noqa: BLE001 - MlflowException, or the HTTP client's own errors
            store = f"MLFLOW_TRACKING_URI={os.environ.get('MLFLOW_TRACKING_URI', 'unset')}"
            if is_outage(e):
                raise TrackerOutage(
                    f"mlflow is unreachable ({store}): {one_line(e, limit=200)}"
                ) from None
            if not isinstance(e, MlflowException):
                raise
            raise UserError(f"mlflow: {one_line(e)} (tracking store: {store})",
                            where="log.report_to") from None
        log.info("mlflow run %s%s", self.run_id, " (resumed)" if state else "")

    def _resume(self, run_id: str | None) -> str | None:
        from mlflow.exceptions import MlflowException

        if not run_id:
            return None
        try:
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        except MlflowException:
            log.warning("mlflow run %s of the checkpoint is not in "
                        "this tracking store; starting a new run", run_id)
            return None

    def _create(self, experiment: str, name: str) -> str:
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = (
            found.experiment_id if found is not None else self.client.create_experiment(experiment)
        )
        return self.client.create_run(experiment_id, run_name=name).info.run_id

    def _log_params(self, params: dict[str, str]) -> None:
        """MLflow parameters cannot change once logged: a resume adds only keys the run lacks."""
        from mlflow.entities import Param

        known = self.client.get_run(self.run_id).data.params
        new = [Param(k, v) for k, v in params.items() if k not in known]
        for start in range(0, len(new), 100):  # MLflow's per-call parameter limit
            self.client.log_batch(self.run_id, params=new[start:start + 100])

    def log(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(self.metric_key(k), v, now, step)
                                                    for k, v in scalars(metrics).items()])

    def metric_key(self, name: str) -> str:
        name = _MLFLOW_BAD.sub("_", name)
        return name.replace("/", ".") if self.file_store else name

    def state(self) -> dict:
        return {"run_id": self.run_id}

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, self.STATUS.get(status, "FAILED"))
