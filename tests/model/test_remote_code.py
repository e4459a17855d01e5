"""trust_remote_code is honoured on every load (config, tokenizer, model), and nothing ever asks:
a model folder whose config.json or tokenizer_config.json maps to its own code (auto_map) is
refused with 78 under trust_remote_code: false (or, for a tokenizer that also has a tokenizer.json,
loaded without its code), from a terminal that would answer "y", and the code never runs."""
from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import MODEL_DIR, ROOT, TRAIN_PROMPTS

EVIL = "import pathlib, os\npathlib.Path(os.environ['PREFTUNE_TEST_MARKER']).touch()\n"


def folder_with_code(tmp_path, where: str):
    model = shutil.copytree(MODEL_DIR, tmp_path / "model")
    (model / "evil.py").write_text(EVIL)
    if where == "config":
        cfg = json.loads((model / "config.json").read_text())
        cfg |= {"model_type": "preftune_evil", "auto_map": {"AutoConfig": "evil.EvilConfig",
                                                           "AutoModelForCausalLM": "evil.EvilModel"}}
        (model / "config.json").write_text(json.dumps(cfg))
    else:
        tok = json.loads((model / "tokenizer_config.json").read_text())
        tok |= {"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}, "tokenizer_class": "EvilTokenizer"}
        (model / "tokenizer_config.json").write_text(json.dumps(tok))
    return model


@pytest.mark.parametrize("where, code", [("config", 78), ("tokenizer", 0)])
def test_remote_code_is_refused_without_a_prompt(tmp_path, where, code):
    model, marker = folder_with_code(tmp_path, where), tmp_path / "MARKER"
    master, slave = pty.openpty()  # stdin is a terminal: transformers would ask here
    os.write(master, b"y\ny\ny\n")  # and the terminal answers yes
    env = dict(os.environ, PYTHONPATH=str(ROOT), PREFTUNE_TEST_MARKER=str(marker), OMP_NUM_THREADS="1")
    args = ["train", "examples/grpo.yaml", f"model.name_or_path={model}", f"data.train={TRAIN_PROMPTS}",
            f"output_dir={tmp_path / 'run'}", "max_steps=1", "log.progress_bar=false"]
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "preftune", *args], stdin=slave, capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=300)
    os.close(master), os.close(slave)
    assert p.returncode == code, p.stderr[-3000:]
    assert not marker.exists() and "Do you wish to run the custom code" not in p.stdout + p.stderr
    if code == 78:
        assert "model.trust_remote_code: true" in p.stderr.strip().splitlines()[-1], p.stderr[-2000:]
        assert not (tmp_path / "run").exists()
    assert time.monotonic() - t0 < 120


def test_a_pickled_pytorch_model_bin_is_exit_78_and_never_runs(tmp_path, capsys):
    """Issue 25: a pytorch_model.bin holding arbitrary objects gave exit 1 (a crash)."""
    from preftune.cli.command import main
    from tests.run.test_data_only import payload

    model = tmp_path / "model"
    shutil.copytree(MODEL_DIR, model, ignore=shutil.ignore_patterns("*.safetensors"))
    marker = tmp_path / "MARKER"
    (model / "pytorch_model.bin").write_bytes(payload(marker))
    (tmp_path / "c.yaml").write_text("algorithm: grpo\n")
    rc = main(["train", str(tmp_path / "c.yaml"), f"model.name_or_path={model}", "model.lean_forward=false",
               f"data.train={TRAIN_PROMPTS}", f"output_dir={tmp_path / 'run'}", "max_steps=1", "log.progress_bar=false"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 78 and "cannot load model" in err and not marker.exists(), err
