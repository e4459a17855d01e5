"""Checkpoints are data only: code planted in a checkpoint never runs.

The payload is a pickle whose `__reduce__` creates a marker file (checked live first: unpickling it
creates the marker). It is planted in every file of a step checkpoint, one at a time, in both
layouts (full; sharded), with the manifest rewritten to match (a writer with access to the
folder or the bucket prefix), then the checkpoint is resumed from (`preftune train`, locally and on
a fresh node through the S3 mirror) and exported (`preftune export`): the marker never appears and
no run ends in a traceback. Files the manifest does not list (`shards/.metadata`, an extra
`model.zz.safetensors`, ...) set the checkpoint aside with a line naming the file.
"""
from __future__ import annotations

import logging
import pickle
import shutil
from pathlib import Path

import pytest

from preftune.cli.command import main
from preftune.config import load_config
from preftune.errors import EXIT_CRASH
from preftune.run import checkpoint_folders as ckpt, loop
from preftune.run.resume import find_resume_point
from tests.run.test_resume import data_dir, one_thread, overrides, write_config  # noqa: F401
from tests.s3_server import s3_server

UNLISTED = ("shards/.metadata", "model.zz.safetensors", "pytorch_model.bin", "trainer_state.pt",
            "rank-1.pt", "adapter/adapter_model.bin", ".hidden")


class Plant:
    """Unpickling this creates `marker` (any code could run there)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def payload(marker: Path) -> bytes:
    data = pickle.dumps(Plant(marker))
    pickle.loads(data)  # the payload is live: unpickling it runs its code
    assert marker.exists()
    marker.unlink()
    return data


def sharded_copy(folder: Path, dest: Path, cfg) -> Path:
    """`folder` (full layout) rewritten in the sharded layout (shards/ of one rank, no model files),
    as a 2 -> 1 resume or an export reads it."""
    from preftune.run import shards
    from preftune.model.load import load_model
    from preftune.run.checkpointer import load_weights
    from preftune.run.optim import build_optimizer

    shutil.copytree(folder, dest)
    model = load_model(cfg.model, cfg.model.name_or_path)
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], cfg.optim)
    state = ckpt.load_state(dest)
    load_weights(model, dest, optimizer, state.pop("optimizer"))
    shards.save_sharded(model, optimizer, dest / "shards", 0)
    for name in ("model.safetensors", "trainer_state.json", "trainer_state.safetensors"):
        (dest / name).unlink()
    ckpt.save_state(dest, state)
    ckpt.write_manifest(dest, 2)
    return dest


@pytest.fixture(scope="module")
def checkpoints(data_dir, tmp_path_factory):
    """A 2-step run's step-2 checkpoint in the full and in the sharded layout."""
    tmp = tmp_path_factory.mktemp("source")
    cfg = load_config(None, overrides("online", tmp / "run", data_dir, max_steps=2, save_steps=2))
    loop.train(cfg)
    full = tmp / "run" / "checkpoints" / "step-2"
    return {"full": full, "sharded": sharded_copy(full, tmp / "sharded" / "step-2", cfg)}


def plant(src: Path, dest: Path, name: str, data: bytes, *, listed: bool) -> Path:
    """A copy of checkpoint `src` at `dest` with `data` as its file `name` (the manifest rewritten
    to list it with its hash when `listed`)."""
    shutil.copytree(src, dest)
    (dest / name).parent.mkdir(parents=True, exist_ok=True)
    (dest / name).write_bytes(data)
    if listed and name != ckpt.MANIFEST:
        ckpt.write_manifest(dest, 2)
    return dest


def files_of(folder: Path) -> list[str]:
    return [*ckpt.content_files(folder), ckpt.MANIFEST]


def test_every_file_of_a_checkpoint_is_listed(checkpoints):
    for folder in checkpoints.values():
        names = set(ckpt.read_manifest((folder / ckpt.MANIFEST).read_text())["files"])
        assert names == set(ckpt.content_files(folder)) and ckpt.verify(folder) is None
        assert not [n for n in names if n.endswith((".pt", ".bin", ".pkl", ".metadata", ".distcp"))]


@pytest.mark.parametrize("layout", ["full", "sharded"])
def test_code_planted_in_any_file_never_runs_on_resume_or_export(checkpoints, data_dir, tmp_path, layout, capsys):
    src, marker = checkpoints[layout], tmp_path / "MARKER"
    data = payload(marker)
    cfg = write_config(tmp_path / "run.yaml")
    for i, name in enumerate(files_of(src)):
        out = tmp_path / f"run-{i}"
        step = plant(src, out / "checkpoints" / "step-2", name, data, listed=True)
        exported = plant(src, tmp_path / f"export-{i}" / "step-2", name, data, listed=True)
        rc = main(["train", str(cfg), *overrides("online", out, data_dir, max_steps=3, save_steps=0)])
        assert rc == 0 and not marker.exists(), (layout, name, rc, capsys.readouterr().err[-2000:])
        # set aside (then a fresh start) unless the file is one a resume never reads (a chat template)
        assert step.exists() == name.endswith(".jinja"), name
        assert (out / "checkpoints" / "damaged-step-2").exists() != name.endswith(".jinja"), name
        rc = main(["export", str(exported), "-o", str(tmp_path / f"model-{i}")])
        assert rc == 78 and not marker.exists(), (layout, name, rc, capsys.readouterr().err[-2000:])
    capsys.readouterr()


def test_the_readers_themselves_never_unpickle(checkpoints, tmp_path):
    """Past `verify` (a file that passed it, then changed): each reader of a checkpoint file
    refuses a planted pickle without unpickling it."""
    from preftune.run import shards
    from preftune.config import ModelConfig
    from preftune.model.load import load_model
    from preftune.run.checkpointer import read_weights
    from preftune.tensorfile import TensorFileError
    from tests.conftest import MODEL_DIR

    marker = tmp_path / "MARKER"
    data = payload(marker)
    model = load_model(ModelConfig(), str(MODEL_DIR))
    readers = {"trainer_state.json": lambda f: ckpt.load_state(f), "trainer_state.safetensors": ckpt.load_state,
               "model.safetensors": lambda f: read_weights(model, f),
               "shards/rank-0.json": lambda f: shards.load_sharded(model, None, f / "shards", weights_only=True),
               "shards/rank-0.safetensors": lambda f: shards.load_sharded(model, None, f / "shards", weights_only=True)}
    for i, (name, read) in enumerate(readers.items()):
        src = checkpoints["sharded" if name.startswith("shards") else "full"]
        folder = plant(src, tmp_path / str(i) / "step-2", name, data, listed=True)
        with pytest.raises((TensorFileError, ckpt.CheckpointDamaged)):
            read(folder)
        assert not marker.exists(), name


@pytest.mark.parametrize("name", UNLISTED)
def test_unlisted_files_set_the_checkpoint_aside(checkpoints, data_dir, tmp_path, name, caplog, capsys):
    marker = tmp_path / "MARKER"
    out = tmp_path / "run"
    plant(checkpoints["sharded" if name.startswith("shards") else "full"], out / "checkpoints" / "step-2", name,
          payload(marker), listed=False)
    cfg = load_config(None, overrides("online", out, data_dir, max_steps=3))
    with caplog.at_level(logging.WARNING, logger="preftune"):
        assert find_resume_point(cfg, out, out / "checkpoints", None) is None
    assert f"{name} is not listed in the manifest" in caplog.text and "damaged-step-2" in caplog.text
    assert (out / "checkpoints" / "damaged-step-2" / name).is_file() and not marker.exists()
    assert main(["export", str(out / "checkpoints" / "damaged-step-2"), "-o", str(tmp_path / "m")]) == 78
    assert f"{name} is not listed in the manifest" in capsys.readouterr().err and not marker.exists()


def test_an_unlisted_weights_file_does_not_override_the_weights(checkpoints, tmp_path):
    """Issue 25: an extra model.zz.safetensors was globbed and replaced model.norm.weight."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "step-2"
    shutil.copytree(checkpoints["full"], folder)
    save_file({"model.norm.weight": load_file(str(folder / "model.safetensors"))["model.norm.weight"] * 0},
              str(folder / "model.zz.safetensors"))
    assert ckpt.verify(folder) == "model.zz.safetensors is not listed in the manifest"
    ckpt.write_manifest(folder, 2)  # listed: still never read (the weights are the index's or model.safetensors)
    from preftune.config import ModelConfig
    from preftune.model.load import load_model
    from preftune.run.checkpointer import read_weights

    from tests.conftest import MODEL_DIR

    weights = read_weights(load_model(ModelConfig(), str(MODEL_DIR)), folder)
    assert weights["model.norm.weight"].abs().sum() > 0


@pytest.mark.parametrize("layout", ["full", "sharded"])
def test_code_planted_in_the_bucket_never_runs_on_a_fresh_node(checkpoints, data_dir, tmp_path, layout, capsys,
                                                               caplog):
    """Each file the restore reads, and an unlisted shards/.metadata, planted in the S3 copy; a fresh
    node (empty output_dir) resumes from the bucket."""
    src, marker = checkpoints[layout], tmp_path / "MARKER"
    data = payload(marker)
    cfg = write_config(tmp_path / "run.yaml")
    cases = [(n, True) for n in files_of(src) if not n.startswith(("tokenizer", "special", "chat", "generation"))]
    with s3_server(bucket=f"planted-{layout}") as s3:  # moto's state is per process: a bucket per test
        fs = s3.filesystem()
        for i, (name, listed) in enumerate([*cases, ("shards/.metadata", False)]):
            planted = plant(src, tmp_path / f"src-{i}" / "step-2", name, data, listed=listed)
            prefix = f"{s3.bucket}/runs/{i}"
            fs.put(str(planted), f"{prefix}/", recursive=True)
            uri = s3.url(f"runs/{i}")
            out = tmp_path / f"node-{i}"
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="preftune"):
                rc = main(["train", str(cfg), *overrides("online", out, data_dir, max_steps=3, save_steps=0,
                                                          checkpoint_uri=uri)])
            err = capsys.readouterr().err
            assert rc != EXIT_CRASH and not marker.exists(), (layout, name, rc, err[-2000:])
            assert listed or ("not listed in its manifest" in caplog.text and "fetched checkpoint" not in caplog.text)
            assert listed or fs.exists(f"{prefix}/step-2/shards/.metadata")
