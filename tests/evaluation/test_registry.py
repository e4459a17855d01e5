"""The model registry: appends from concurrent processes never lose a record (local JSONL with
O_APPEND + flock; S3 one object per record), list in time order."""
from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from preftune.cli.command import main
from preftune.errors import EXIT_USER
from preftune.evaluation.registry import append, read
from tests.s3_server import s3_server


def _writer(url: str, who: int, n: int) -> None:
    for i in range(n):
        append(url, {"who": who, "i": i, "pad": "x" * 5000, "time": f"{i:04d}-{who}"})  # long lines: no torn writes


def test_concurrent_local_appends_keep_every_record(tmp_path):
    url = str(tmp_path / "reg" / "registry.jsonl")
    append(url, {"who": -1, "i": 0, "time": "0"})
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(url, w, 40)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    lines = (tmp_path / "reg" / "registry.jsonl").read_text().splitlines()
    assert len(lines) == 121 and all(json.loads(x) for x in lines)  # every line whole
    got = {(r["who"], r["i"]) for r in read(url)}
    assert got == {(-1, 0)} | {(w, i) for w in range(3) for i in range(40)}


@pytest.fixture(scope="module")
def s3():
    with s3_server(bucket="registry") as endpoint:  # moto state is per process: a bucket of our own
        yield endpoint


def test_s3_appends_are_separate_objects_and_none_is_lost(s3):
    import threading

    url = s3.url("models/registry.jsonl")
    threads = [threading.Thread(target=_writer, args=(url, w, 3)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = read(url)
    assert {(r["who"], r["i"]) for r in records} == {(w, i) for w in range(2) for i in range(3)}
    assert [r["time"] for r in records] == sorted(r["time"] for r in records)


def test_registry_list_cli(tmp_path, capsys):
    url = str(tmp_path / "registry.jsonl")
    append(url, {"model_path": "/m/a", "metrics": {"reward": 0.5}, "time": "2026-01-01T00:00:00"})
    assert main(["registry", "list", "--registry", url]) == 0
    out = capsys.readouterr().out
    assert "/m/a" in out and "0.500" in out
    assert main(["registry", "list", "--registry", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_path"] == "/m/a"
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert main(["registry", "list", "--registry", str(tmp_path / "bad.jsonl")]) == EXIT_USER
    assert "line 1 is not JSON" in capsys.readouterr().err
