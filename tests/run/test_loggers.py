"""log.report_to with the real libraries, offline: W&B in offline mode into the run folder, MLflow with
what a fresh install gets (no MLFLOW_* variable: MLflow's default sqlite store in the working
directory), TensorBoard; what they got is read back. A resumed run continues the same runs; a
credential in the config reaches none of them. A tracker unreachable at the start: exit 69, or
with log.on_tracker_outage: local, a run with metrics.jsonl only."""
from __future__ import annotations

import json
import signal
import struct
import sys

import pytest

from preftune.config import load_config
from preftune.errors import UserError
import preftune
from tests.conftest import MODEL_DIR, TRAIN_PROMPTS


def test_report_to_names_and_missing_extras(monkeypatch):
    base = [f"data.train={TRAIN_PROMPTS}"]
    assert load_config(None, base + ["log.report_to=[tensorboard, wandb, mlflow]"]).log.report_to == \
        ["tensorboard", "wandb", "mlflow"]
    with pytest.raises(UserError, match="log.report_to: 'neptune' is not one of tensorboard, wandb, mlflow"):
        load_config(None, base + ["log.report_to=[neptune]"])
    for name in ("wandb", "mlflow"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
        with pytest.raises(UserError, match=rf"log.report_to: {name} is not installed: pip install 'preftune\[{name}\]'"):
            load_config(None, base + [f"log.report_to=[{name}]"])


def wandb_records(path):
    """The protobuf records of an offline W&B run file (its LevelDB-style log: 32 KiB blocks, each record
    split into chunks with a 7-byte header: crc32, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # block padding
            pos += room
            continue
        parts = (b"" if kind in (1, 2) else parts) + data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            yield record


def wandb_history(run_file) -> tuple[list[dict], dict]:
    rows, config = [], {}
    for rec in wandb_records(run_file):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item})
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in rec.config.update})
    return rows, config


SECRET = "hf_s3cr3tTokenValue0123456789"


def test_wandb_mlflow_tensorboard_together_and_resumed(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)  # a fresh install: MLflow's own default store
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    opts = {"output_dir": str(out), "model.name_or_path": str(MODEL_DIR), "max_steps": 3, "save_steps": 0,
            "log.progress_bar": False, "grpo.prompts_per_step": 2, "grpo.num_generations": 4,
            "grpo.max_completion_length": 3, "data.max_prompt_length": 16, "data.train": str(TRAIN_PROMPTS),
            "data.eval": str(TRAIN_PROMPTS), "eval.batch_size": 8, "log.report_to": ["tensorboard", "wandb", "mlflow"],
            "log.project": "preftune-test", "grpo.beta": 0.04, "deploy.env": {"HF_TOKEN": SECRET}}
    before = (sys.excepthook, signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), sys.stdout)
    first = preftune.train({}, overrides=opts, callbacks=[lambda step, m: step == 1 and "loss" in m])
    assert first.stopped_early and first.step == 1
    preftune.train({}, overrides=opts)  # resumes from the step-1 checkpoint
    assert (sys.excepthook, signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), sys.stdout) == before
    jsonl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_keys = {k for r in jsonl if "loss" in r for k in r if k != "step" and r[k] is not None}

    # W&B: two offline run folders (first run, resumed run) with one id; the metric names of metrics.jsonl
    run_files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 2 and len({f.name for f in run_files}) == 1
    history, config = [], {}
    for f in run_files:
        rows, cfg = wandb_history(f)
        history += rows
        config.update(cfg)
    assert [r["_step"] for r in history if "loss" in r] == [1, 2, 3]
    assert train_keys <= {k for r in history for k in r}
    assert [r["eval/reward"] for r in history if "eval/reward" in r][-1] == jsonl[-1]["eval/reward"]
    assert config["grpo"]["beta"] == 0.04 and config["output_dir"] == str(out)

    # MLflow: one run, continued; metric history per step, config as parameters, finished
    client = MlflowClient()
    experiment = client.get_experiment_by_name("preftune-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED" and runs[0].info.run_name == "run"
    run_id = runs[0].info.run_id
    loss = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in loss] == [(r["step"], r["loss"]) for r in jsonl if "loss" in r]
    assert client.tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"  # MLflow's default, no variable set
    evals = client.get_metric_history(run_id, "eval/rewards/accuracy/mean")
    assert [(m.step, m.value) for m in evals][-1] == (3, jsonl[-1]["eval/rewards/accuracy/mean"])
    assert train_keys <= set(client.get_run(run_id).data.metrics)
    params = client.get_run(run_id).data.params
    assert params["grpo.beta"] == "0.04" and params["deploy.env.HF_TOKEN"] == "<redacted>"
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    # the credential: in no tracker, no config copy, no checkpoint
    assert config["deploy"]["env"]["HF_TOKEN"] == "<redacted>"
    assert SECRET not in str(params)
    written = [*run_files, *out.rglob("*.yaml"), *out.rglob("*.json"), tmp_path / "mlflow.db"]
    assert all(SECRET.encode() not in f.read_bytes() for f in written), [f for f in written if SECRET.encode() in f.read_bytes()]
    assert (out / "final" / "preftune.yaml").is_file() and (out / "config.yaml").is_file()


def test_a_failing_tracker_does_not_stop_the_run(tmp_path, caplog):
    from preftune.run.metrics import MetricsLog, read_records

    class Down:
        key = "mlflow"
        closed = None

        def log(self, step, metrics):
            raise ConnectionError("server unreachable")

        def state(self):
            return {"run_id": "r1"}

        def close(self, status):
            Down.closed = status

    m = MetricsLog(tmp_path, total_steps=2, start_step=-1, progress=False, trackers=[Down()])
    m.log(1, {"loss": 1.0})
    m.log(2, {"loss": float("nan")})
    assert m.state_dict() == {"mlflow": {"run_id": "r1"}}
    m.close("preempted")
    m.close("finished")  # a second close changes nothing
    assert read_records(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": None}]
    assert Down.closed == "preempted"
    assert sum("logging to mlflow failed" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("policy, code", [("fail", 69), ("local", 0)])
def test_an_unreachable_tracker_at_the_start(tmp_path, monkeypatch, capsys, caplog, policy, code):
    """Issue 25: an unreachable MLflow server gave 78 (a config error), which the job policy aborts on."""
    import socket

    from preftune.cli.command import main
    from preftune.run.metrics import read_records

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    out = tmp_path / "run"
    args = [f"output_dir={out}", f"model.name_or_path={MODEL_DIR}", f"data.train={TRAIN_PROMPTS}", "max_steps=2",
            "save_steps=0", "log.progress_bar=false", "grpo.prompts_per_step=2", "grpo.num_generations=4",
            "grpo.max_completion_length=3", "data.max_prompt_length=16", "log.report_to=[mlflow]",
            f"log.on_tracker_outage={policy}"]
    (tmp_path / "c.yaml").write_text("algorithm: grpo\n")
    with caplog.at_level("WARNING", logger="preftune"):
        assert main(["train", str(tmp_path / "c.yaml"), *args]) == code
    err = capsys.readouterr().err
    if code:
        assert "mlflow is unreachable" in err.strip().splitlines()[-1] and "Traceback" not in err
    else:
        assert "going on with metrics.jsonl only" in caplog.text
        assert [r["step"] for r in read_records(out / "metrics.jsonl") if "loss" in r] == [1, 2]
