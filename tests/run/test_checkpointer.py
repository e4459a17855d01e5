"""The checkpointer on one process: LoRA step checkpoints hold the adapter only (no merged copy per
save), final/ is the merged model, and `preftune export` rebuilds that model from a step checkpoint."""
from __future__ import annotations

import torch

from preftune.cli.command import main
from preftune.config import load_config
from preftune.run import checkpoint_folders as ckpt, loop
from tests.hf_folder import folder_state
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
    a, b = folder_state(tmp_path / "exported"), folder_state(out / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_full_disk_during_a_save_is_one_line_with_its_errno_and_the_rerun_continues(data_dir, tmp_path, monkeypatch,
                                                                                     capsys):
    import errno

    from preftune import tensorfile
    from preftune.cli.command import main
    from preftune.errors import EXIT_UNAVAILABLE
    from tests.run.test_resume import saved_steps, write_config

    out, real, calls = tmp_path / "run", tensorfile.write_pair, []

    def full(stem, *a, **k):
        calls.append(stem)
        if stem.parent.name.startswith(".tmp-step-2"):
            raise OSError(errno.ENOSPC, "No space left on device", str(stem))
        return real(stem, *a, **k)

    args = ["train", str(write_config(tmp_path / "run.yaml")), *overrides("online", out, data_dir, max_steps=3,
                                                                             save_steps=1)]
    with monkeypatch.context() as m:
        m.setattr(tensorfile, "write_pair", full)
        assert main(args) == EXIT_UNAVAILABLE
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "cannot write checkpoint step-2" in line and "[Errno 28] No space left on device" in line, line
    assert saved_steps(out) == [1] and ckpt.verify(out / "checkpoints" / "step-1") is None
    assert main(args) == 0 and saved_steps(out) == [3, 2, 1]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(ckpt.TMP_PREFIX)]
