"""A run that knows it is complete (in process): the end checkpoint is kept even with save_steps 0,
a larger max_steps continues from it bitwise like one longer run (GRPO and DPO), the same config
again does nothing, DPO's reference log-probs and the step-0 evaluation come from the checkpoint on
a resume, and startup_seconds is in the first record of each process."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from preftune.algorithms import dpo as dpo_task
from preftune.config import load_config
from preftune.errors import UserError
from preftune.run import completion, loop
from preftune.run.startup import PHASES, STARTUP_KEYS
from tests.run.test_resume import (  # noqa: F401 - fixtures used by name
    assert_same_run, data_dir, one_thread, overrides, saved_steps, small_eval,
)

ROOT = Path(__file__).resolve().parents[2]
CONSTANT = {"optim.lr_scheduler": "constant", "save_steps": 0}  # a decaying LR depends on max_steps


def raw_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("kind", ["online", "dpo"])
def test_raising_max_steps_continues_from_the_end_like_one_longer_run(kind, data_dir, tmp_path, monkeypatch):
    extra = CONSTANT | {"data.eval": small_eval(data_dir)}
    longer = tmp_path / "longer"
    loop.train(load_config(None, overrides(kind, longer, data_dir, max_steps=6, **extra)))
    out = tmp_path / "run"
    loop.train(load_config(None, overrides(kind, out, data_dir, max_steps=3, **extra)))
    assert saved_steps(out) == [3]  # the end state, although save_steps is 0
    refs = []
    monkeypatch.setattr(dpo_task, "reference_logps", lambda *a, **k: refs.append(1))
    evals = []
    real_eval = loop.Run._eval
    monkeypatch.setattr(loop.Run, "_eval", lambda self: evals.append(self.step) or real_eval(self))
    loop.train(load_config(None, overrides(kind, out, data_dir, max_steps=6, **extra)))
    assert refs == [] and evals == [6]  # from the checkpoint: no reference pass, no step-0 evaluation
    assert saved_steps(out) == [6, 3]
    assert_same_run(longer, out)


def test_the_same_config_again_does_nothing(data_dir, tmp_path, monkeypatch):
    cfg = load_config(None, overrides("online", tmp_path / "run", data_dir, max_steps=2, save_steps=0))
    final = loop.train(cfg)
    assert completion.completed(cfg) == f"{final} (step 2)"
    monkeypatch.setattr(loop, "Run", None)  # nothing may be built
    assert loop.train(cfg) == final
    other = load_config(None, overrides("online", tmp_path / "run", data_dir, max_steps=2, save_steps=0, seed=1))
    with pytest.raises(UserError, match="seed: 0 -> 1"):  # a different run: refused, not "already complete"
        completion.completed(other)
    never = load_config(None, overrides("online", tmp_path / "run", data_dir, max_steps=2, resume="never"))
    assert completion.completed(never) is None


def test_final_without_its_manifest_is_not_complete(data_dir, tmp_path):
    cfg = load_config(None, overrides("online", tmp_path / "run", data_dir, max_steps=2, save_steps=0))
    final = loop.train(cfg)
    (final / "MANIFEST.json").unlink()
    assert completion.completed(cfg) is None


def test_startup_seconds_in_the_first_record_of_each_process(data_dir, tmp_path, caplog):
    ovr = overrides("online", tmp_path / "run", data_dir, max_steps=2, save_steps=0)
    with caplog.at_level("INFO", logger="preftune"):
        loop.train(load_config(None, ovr))
    first, second = [r for r in raw_records(tmp_path / "run") if "loss" in r]
    assert set(STARTUP_KEYS) <= first.keys() and not set(STARTUP_KEYS) & second.keys()
    parts = sum(first[f"startup/{p}"] for p in PHASES)
    assert first["startup_seconds"] == pytest.approx(parts) and first["startup/model"] > 0
    assert "startup " in caplog.text and "model " in caplog.text


def test_entry_imports_nothing_heavy():
    """The handler is installed before torch: `import preftune.cli.command` (whose `script` installs it first) and
    the handler's module must stay light."""
    code = ("import sys, signal, preftune.cli.command, preftune.run.preemption as p; p.install_process_handler(); heavy = [m for m in ('torch', 'numpy', 'transformers', 'yaml') "
            "if m in sys.modules]; print(heavy, signal.getsignal(signal.SIGTERM).__qualname__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}).stdout
    assert out.strip() == "[] Preemption._handle"


def test_with_a_mirror_the_remote_final_decides(data_dir, tmp_path, monkeypatch):
    import shutil

    remote = tmp_path / "remote"
    cfg = load_config(None, overrides("online", tmp_path / "run", data_dir, max_steps=2, save_steps=0,
                                      checkpoint_uri=f"file://{remote}"))
    loop.train(cfg)
    assert sorted(p.name for p in remote.iterdir()) == ["final", "step-2"]
    shutil.rmtree(tmp_path / "run")  # a fresh node: nothing local, the remote says the run is done
    assert completion.completed(cfg) == f"file://{remote}/final (step 2)"
    monkeypatch.setattr(loop, "Run", None)
    loop.train(cfg)
    assert not (tmp_path / "run").exists()  # touched nothing, downloaded nothing
    (remote / "final" / "MANIFEST.json").unlink()  # the final upload never finished
    assert completion.completed(cfg) is None
