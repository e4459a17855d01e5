"""Checkpoint folders: atomic publish, manifest verification, retention, safe trainer-state loading,
hard-link snapshots, and that a checkpoint's model loads with transformers."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from preftune.errors import CheckpointDamaged
from preftune.run import checkpoint_folders as ckpt
from preftune.run.checkpointer import rng_state, set_rng_state

EXAMPLE_MODEL = Path(__file__).resolve().parents[2] / "examples" / "model"


def writer(payload: bytes, extra: dict[str, bytes] | None = None):
    def write(tmp: Path) -> None:
        (tmp / "model.bin").write_bytes(payload)
        for name, data in (extra or {}).items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)

    return write


def steps(root: Path) -> list[int]:
    return [s for s, _ in ckpt.list_checkpoints(root)]


def test_save_publishes_a_verified_folder_with_manifest_last(tmp_path):
    root = tmp_path / "checkpoints"
    folder = ckpt.save(root, 3, writer(b"abc", {"sub/x.txt": b"hello"}))
    assert folder == root / "step-3" and steps(root) == [3]
    manifest = json.loads((folder / ckpt.MANIFEST).read_text())
    assert manifest["step"] == 3
    assert set(manifest["files"]) == {"model.bin", "sub/x.txt"}
    assert manifest["files"]["sub/x.txt"]["size"] == 5
    assert ckpt.verify(folder) is None
    assert not [p for p in root.iterdir() if p.name.startswith(ckpt.TMP_PREFIX)]


@pytest.mark.parametrize("damage, words", [
    (lambda f: (f / "model.bin").write_bytes(b"abd"), "checksum"),
    (lambda f: (f / "model.bin").write_bytes(b"abcd"), "bytes"),
    (lambda f: (f / "model.bin").unlink(), "missing"),
    (lambda f: (f / ckpt.MANIFEST).unlink(), "MANIFEST"),
    (lambda f: (f / ckpt.MANIFEST).write_text('{"files": {"../../etc/passwd": {}}}'), "MANIFEST"),
])
def test_verify_names_what_is_wrong(tmp_path, damage, words):
    folder = ckpt.save(tmp_path, 1, writer(b"abc"))
    damage(folder)
    problem = ckpt.verify(folder)
    assert problem is not None and words in problem


def test_a_killed_save_leaves_only_scratch_which_is_never_listed(tmp_path):
    """A save that dies after writing everything (manifest included) but before the rename."""
    root = tmp_path / "checkpoints"
    ckpt.save(root, 2, writer(b"two"))

    def dies(tmp: Path) -> None:
        writer(b"four")(tmp)
        raise KeyboardInterrupt  # stands in for SIGKILL: nothing after this line runs

    with pytest.raises(KeyboardInterrupt):
        ckpt.save(root, 4, dies)
    assert steps(root) == [2]
    assert [p.name for p in root.iterdir() if p.name.startswith(ckpt.TMP_PREFIX + "step-4")]
    ckpt.clean_stale(root)
    assert [p.name for p in root.iterdir()] == ["step-2"]


def test_resave_of_the_same_step_replaces_it(tmp_path):
    ckpt.save(tmp_path, 5, writer(b"old", {"stale.txt": b"x"}))
    folder = ckpt.save(tmp_path, 5, writer(b"new"))
    assert (folder / "model.bin").read_bytes() == b"new"
    assert not (folder / "stale.txt").exists() and ckpt.verify(folder) is None
    assert [p.name for p in tmp_path.iterdir()] == ["step-5"]


def test_save_total_limit_keeps_the_newest_k(tmp_path):
    for s in (1, 2, 3, 10, 11):
        ckpt.save(tmp_path, s, writer(str(s).encode()), keep=3)
    assert steps(tmp_path) == [11, 10, 3]  # by step number, not by name order ("10" < "3")
    ckpt.save(tmp_path, 12, writer(b"12"), keep=1)
    assert steps(tmp_path) == [12]


def test_trainer_state_round_trips_as_data(tmp_path):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))], lr=0.1)
    opt.param_groups[0]["params"][0].grad = torch.ones(3)
    opt.step()
    shared = torch.arange(6.0)
    task = {"pos": [1, 2], "x": None, "t": (1, "a"), 3: float("inf"), "$odd": 1.5, "views": [shared[:3], shared]}
    state = {"step": 7, "optimizer": opt.state_dict(), "rng": rng_state(), "task": task}
    ckpt.save_state(tmp_path, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trainer_state.json", "trainer_state.safetensors"]
    back = ckpt.load_state(tmp_path)
    assert back["step"] == 7 and back["task"]["pos"] == [1, 2] and back["task"]["x"] is None
    assert back["task"]["t"] == (1, "a") and back["task"][3] == float("inf") and back["task"]["$odd"] == 1.5
    assert torch.equal(back["task"]["views"][1], shared) and torch.equal(back["task"]["views"][0], shared[:3])
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert back["optimizer"]["param_groups"] == opt.state_dict()["param_groups"]
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"]) and back["rng"]["python"] == state["rng"]["python"]


class Payload:
    """An arbitrary object: unpickling it would run code."""

    ran = False

    def __reduce__(self):
        return (Payload._run, ())

    @staticmethod
    def _run():
        Payload.ran = True
        return "pwned"


def test_trainer_state_with_arbitrary_objects_is_never_written_or_read(tmp_path):
    with pytest.raises(TypeError, match="Payload cannot be written"):
        ckpt.save_state(tmp_path, {"step": 1, "evil": Payload()})
    Payload.ran = False
    for name in ckpt.state_files():  # a pickle in either file is refused without being unpickled
        ckpt.save_state(tmp_path, {"step": 1})
        torch.save({"step": 1, "evil": Payload()}, tmp_path / name)
        with pytest.raises(CheckpointDamaged, match="trainer_state"):
            ckpt.load_state(tmp_path)
    assert not Payload.ran


def test_rng_state_restores_python_numpy_and_torch_streams():
    import random

    import numpy as np

    np.random.normal()  # leaves a cached gaussian in numpy's legacy state: it must be restored too
    saved = rng_state()
    first = (random.random(), random.gauss(0, 1), np.random.normal(), np.random.rand(), torch.rand(2))
    set_rng_state(saved)
    again = (random.random(), random.gauss(0, 1), np.random.normal(), np.random.rand(), torch.rand(2))
    assert first[:4] == again[:4] and torch.equal(first[4], again[4])


def test_snapshot_survives_deletion_of_the_original(tmp_path):
    folder = ckpt.save(tmp_path / "c", 1, writer(b"weights", {"a/b.txt": b"x"}))
    snap = ckpt.snapshot(folder, tmp_path / "snap")
    shutil.rmtree(folder)
    assert (snap / "model.bin").read_bytes() == b"weights" and (snap / "a" / "b.txt").read_bytes() == b"x"
    assert ckpt.verify(snap) is None


def test_checkpoint_model_loads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from preftune.model.load import save_pretrained

    model = AutoModelForCausalLM.from_pretrained(str(EXAMPLE_MODEL))
    with torch.no_grad():
        next(model.parameters()).add_(0.5)  # differs from the base, so loading the base would fail the check
    tok = AutoTokenizer.from_pretrained(str(EXAMPLE_MODEL))
    folder = ckpt.save(tmp_path, 1, lambda tmp: save_pretrained(model, tok, tmp))
    back = AutoModelForCausalLM.from_pretrained(str(folder))
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    assert os.path.exists(folder / "tokenizer.json")
