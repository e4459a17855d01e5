"""One rank of the sliced-loading / sharded-final test (tests/distributed/test_weights.py), started
with torchrun's variables: `python -m tests.distributed.weights_ranks MODEL OUT`.

In one process, in this order (the new path first, on a fresh process): load the model sliced,
write final/ sharded, then load it through rank 0's broadcast (the old path) and write the old
gathered final/ beside it. Each phase's peak host memory above the resident memory before it
(VmHWM, reset through /proc/self/clear_refs) is measured; rank 0 writes the numbers, and every
rank whether its shards from both loads are bitwise equal, to OUT/rank-R.json."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401 - torch's lazy imports, made by any run, are not the load's memory

from preftune.cli.command import finish
from preftune.config import Config
from preftune.distributed import fsdp
from preftune.distributed.group import Parallel
from preftune.model.load import load_tokenizer
from preftune.run.checkpointer import Checkpointer

ROOT = Path(__file__).resolve().parents[2]


def _status(key: str) -> int:
    """A /proc/self/status memory line in bytes."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+) kB", text)[1]) * 1024


def measured(fn):
    """fn's result and the peak resident memory it added above what was resident before it."""
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts at the resident
    before = _status("VmRSS")
    out = fn()
    return out, _status("VmHWM") - before


def local_bytes(model) -> int:
    return sum(p.to_local().numel() * p.element_size() for p in model.parameters())


def main(model_dir: str, out: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    dp = Parallel(rank, world, 0, "fsdp", torch.device("cpu"))
    cfg = Config()
    cfg.model.name_or_path, cfg.model.dtype = model_dir, "float32"
    tok = load_tokenizer(str(ROOT / "examples" / "model"))
    result: dict = {}

    def final(model, name: str, gathered: bool):
        cfg.output_dir = str(Path(out) / name)
        ck = Checkpointer(cfg, dp, model=model, tokenizer=tok, optimizer=None, task=None)
        return (ck._write_final_gathered if gathered else ck.write_final)(3)

    new, result["load_new"] = measured(lambda: fsdp.load(dp, cfg.model, model_dir))
    result["shard"] = local_bytes(new)
    _, result["final_new"] = measured(lambda: final(new, "new", False))
    old, result["load_old"] = measured(lambda: fsdp.load(dp, cfg.model, model_dir, sliced=False))
    _, result["final_old"] = measured(lambda: final(old, "old", True))
    result["same_shards"] = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(new.parameters(), old.parameters(), strict=True))
    result["same_buffers"] = all(
        torch.equal(a, b) for a, b in zip(new.buffers(), old.buffers(), strict=True))
    Path(out, f"rank-{rank}.json").write_text(json.dumps(result))
    dp.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    finish(0)  # as the CLI exits: a gloo group freed in the teardown's last collection aborts it
