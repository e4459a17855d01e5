"""The remote checkpoint mirror: an S3 round trip against a real S3-compatible server (moto) with the
local folder deleted in between; uploads that never block the step and survive retention deleting
their source; superseded and failed uploads; damaged or incomplete remote checkpoints skipped."""
from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from preftune.config import load_config
from preftune.errors import Preempted, UserError
from preftune.run import checkpoint_folders as ckpt, loop
from preftune.run.mirror import RemoteMirror
from preftune.run.resume import find_resume_point
from tests.s3_server import s3_server
from tests.run.test_resume import (  # noqa: F401 - fixtures used by name
    assert_same_run, data_dir, one_thread, overrides, reference, saved_steps, sigterm_during,
)


def fake_checkpoint(writer_root: Path, step: int, payload: bytes, keep: int | None = None) -> Path:
    def write(tmp: Path) -> None:
        (tmp / "weights.bin").write_bytes(payload)  # opaque bytes: verify checks only their hash
        (tmp / "sub").mkdir()
        (tmp / "sub" / "state.pt").write_bytes(payload[::-1])

    return ckpt.save(writer_root, step, write, keep=keep)


def remote_names(remote: Path) -> list[str]:
    return sorted(p.name for p in remote.iterdir()) if remote.exists() else []


def test_s3_round_trip_with_the_local_folder_deleted(reference, data_dir, tmp_path, monkeypatch, caplog):
    ref = reference("online")
    out = tmp_path / "run"
    with s3_server(bucket="ckpts") as s3:
        extra = {"checkpoint_uri": s3.url("runs/a"), "save_total_limit": 2}
        ovr = overrides("online", out, data_dir, **extra)
        with monkeypatch.context() as m:
            sigterm_during(m, 3)
            with pytest.raises(Preempted, match="step-3 saved"):
                loop.train(load_config(None, ovr))
        fs = s3.filesystem()
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("ckpts/runs/a")) == ["step-2", "step-3"]
        assert fs.exists("ckpts/runs/a/step-3/MANIFEST.json")
        shutil.rmtree(out)  # the spot node is gone with its disk
        with caplog.at_level("INFO", logger="preftune"):
            loop.train(load_config(None, ovr))
        assert "fetched checkpoint step-3" in caplog.text
        fs.invalidate_cache()
        # the end checkpoint (step 5) too: a larger max_steps continues from it, even on a fresh node
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("ckpts/runs/a")) == ["final", "step-4", "step-5"]
        assert fs.exists("ckpts/runs/a/final/model.safetensors")
        assert fs.exists("ckpts/runs/a/step-5/MANIFEST.json")
    assert saved_steps(out) == [5, 4]
    assert_same_run(ref, out)  # weights and every metrics record, though the local folder was deleted


def test_upload_never_blocks_and_survives_retention(tmp_path, monkeypatch):
    root, remote = tmp_path / "checkpoints", tmp_path / "remote"
    mirror = RemoteMirror(f"file://{remote}")
    gate, started = threading.Event(), threading.Event()
    put = mirror.fs.put_file

    def slow_put(src, dst, **kw):
        started.set()
        assert gate.wait(30)
        return put(src, dst, **kw)

    monkeypatch.setattr(mirror.fs, "put_file", slow_put)  # fsspec caches instances: undo after the test
    mirror.upload(fake_checkpoint(root, 1, b"one", keep=1))
    assert started.wait(10)
    t0 = time.monotonic()
    mirror.upload(fake_checkpoint(root, 2, b"two", keep=1))  # deletes local step-1 mid-upload
    assert time.monotonic() - t0 < 2.0 and not mirror.wait(timeout=0.05)
    assert saved_steps(root.parent) == [2]
    gate.set()
    assert mirror.wait(timeout=30) and mirror.failures == 0
    assert remote_names(remote) == ["step-1", "step-2"]
    for name in ("step-1", "step-2"):
        assert ckpt.verify(remote / name) is None  # complete, though its source folder was deleted
    assert not [p for p in root.iterdir() if p.name.startswith(ckpt.TMP_PREFIX)]  # snapshots removed


def test_a_queued_upload_is_superseded_by_a_newer_one(tmp_path, monkeypatch):
    root, remote = tmp_path / "checkpoints", tmp_path / "remote"
    mirror = RemoteMirror(str(remote))
    gate = threading.Event()
    put = mirror.fs.put_file
    monkeypatch.setattr(mirror.fs, "put_file", lambda src, dst, **kw: gate.wait(30) and put(src, dst, **kw))
    for step in (1, 2, 3):
        mirror.upload(fake_checkpoint(root, step, f"w{step}".encode()))
    gate.set()
    assert mirror.wait(timeout=30)
    assert remote_names(remote) == ["step-1", "step-3"]


def test_remote_keeps_the_newest_k_and_failures_do_not_raise(tmp_path, caplog, monkeypatch):
    root, remote = tmp_path / "checkpoints", tmp_path / "remote"
    mirror = RemoteMirror(str(remote), keep=2)
    for step in (1, 2, 3):
        mirror.upload(fake_checkpoint(root, step, b"w"))
        assert mirror.wait(timeout=30)
    assert remote_names(remote) == ["step-2", "step-3"]

    def broken(*a, **k):
        raise OSError("network is down")

    monkeypatch.setattr(mirror.fs, "put_file", broken)
    with caplog.at_level("WARNING", logger="preftune"):
        mirror.upload(fake_checkpoint(root, 4, b"w"))
        assert mirror.wait(timeout=30)
    assert mirror.failures == 1 and "network is down" in caplog.text
    assert remote_names(remote) == ["step-2", "step-3", "step-4"]
    assert not (remote / "step-4" / ckpt.MANIFEST).exists()  # never looks complete
    monkeypatch.undo()
    mirror.upload(fake_checkpoint(root, 5, b"w"))
    assert mirror.wait(timeout=30)
    # the newest 2 complete ones stay; the failed (incomplete) step-4 is older than the newest: deleted
    assert remote_names(remote) == ["step-3", "step-5"]


def test_download_skips_incomplete_and_damaged_remote_checkpoints(tmp_path):
    src_root, remote, local = tmp_path / "src", tmp_path / "remote", tmp_path / "local" / "checkpoints"
    mirror = RemoteMirror(str(remote))
    for step in (1, 2, 3):
        mirror.upload(fake_checkpoint(src_root, step, f"weights-{step}".encode()))
        assert mirror.wait(timeout=30)
    (remote / "step-3" / ckpt.MANIFEST).unlink()  # an upload that never finished
    (remote / "step-2" / "sub" / "state.pt").write_bytes(b"tampered")  # damaged in storage
    local.mkdir(parents=True)
    (local / "step-1").mkdir()
    (local / "step-1" / "junk").write_text("a damaged local copy of the same step")
    got = mirror.download_newest(local)
    assert got == local / "step-1" and ckpt.verify(got) is None
    assert (got / "weights.bin").read_bytes() == b"weights-1" and not (got / "junk").exists()
    assert not [p for p in local.iterdir() if p.name.startswith(ckpt.TMP_PREFIX)]


def test_download_refuses_paths_outside_the_checkpoint(tmp_path):
    remote = tmp_path / "remote"
    (remote / "step-1").mkdir(parents=True)
    evil = {"step": 1, "files": {"../../escaped.txt": {"size": 1, "sha256": "0"}}}
    (remote / "step-1" / ckpt.MANIFEST).write_text(json.dumps(evil))
    local = tmp_path / "a" / "b" / "checkpoints"
    local.mkdir(parents=True)
    assert RemoteMirror(str(remote)).download_newest(local) is None
    assert not list(tmp_path.rglob("escaped.txt"))


def test_resume_never_with_remote_checkpoints(data_dir, tmp_path):
    root, remote = tmp_path / "src", tmp_path / "remote"
    mirror = RemoteMirror(str(remote))
    mirror.upload(fake_checkpoint(root, 1, b"w"))
    assert mirror.wait(timeout=30)
    out = tmp_path / "run"
    cfg = load_config(None, overrides("online", out, data_dir, resume="never", checkpoint_uri=remote))
    with pytest.raises(UserError, match="holds checkpoints"):
        find_resume_point(cfg, out, out / "checkpoints", mirror)
    cfg.overwrite_output_dir = True
    assert find_resume_point(cfg, out, out / "checkpoints", mirror) is None
    assert remote_names(remote) == []


def test_bad_checkpoint_uri_is_a_user_error():
    with pytest.raises(UserError, match="checkpoint_uri"):
        RemoteMirror("nosuchprotocol://bucket/x")
