"""The checkpointer on one process: LoRA step checkpoints hold the adapter only (no merged copy per
save), final/ is the merged model, and `preftune export` rebuilds that model from a step checkpoint."""
from __future__ import annotations

import torch
from safetensors.torch import load_file

from preftune.cli import main
from preftune.config import load_config
from preftune.run import checkpoint as ckpt, loop
from tests.run.test_resume import data_dir, one_thread, overrides  # noqa: F401 - fixtures used by name


def test_lora_step_checkpoints_hold_the_adapter_and_export_merges_it(data_dir, tmp_path):
    out = tmp_path / "run"
    loop.train(load_config(None, overrides("dpo", out, data_dir, max_steps=2, save_steps=2,
                                           **{"model.lora.enabled": "true", "model.lora.r": 4})))
    step = out / "checkpoints" / "step-2"
    files = set(ckpt.read_manifest((step / ckpt.MANIFEST).read_text())["files"])
    assert "adapter/adapter_model.safetensors" in files and set(ckpt.state_files()) <= files
    assert not [f for f in files if f.startswith("model")]  # no merged model per save
    state = ckpt.load_state(step)
    assert all("lora_" in name for name in state["optimizer"]["param_groups"][0]["params"])
    assert main(["export", str(step), "-o", str(tmp_path / "exported")]) == 0
    a, b = load_file(str(tmp_path / "exported" / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
