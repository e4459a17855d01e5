"""One process of tests/model/test_load_memory.py: `python -m tests.model.load_memory MODEL OUT`.

Loads MODEL (float32) with load.load_model and writes its final/ as a run does, each phase's peak
host memory above the resident memory before it measured (tests/distributed/weights_ranks.py),
then checks the loaded parameters bit for bit against the files read whole; the numbers go to
OUT/result.json."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from preftune.config import Config
from preftune.distributed.group import Parallel
from preftune.model.load import load_model, load_tokenizer
from preftune.run.checkpointer import Checkpointer
from tests.distributed.weights_ranks import ROOT, measured


def main(model_dir: str, out: str) -> None:
    cfg = Config()
    cfg.model.name_or_path, cfg.model.dtype, cfg.output_dir = model_dir, "float32", out
    tok = load_tokenizer(str(ROOT / "examples" / "model"))
    result: dict = {}
    model, result["load"] = measured(lambda: load_model(cfg.model, model_dir))
    result["model"] = sum(p.numel() * p.element_size() for p in model.parameters())
    ck = Checkpointer(cfg, Parallel(), model=model, tokenizer=tok, optimizer=None, task=None)
    _, result["final"] = measured(lambda: ck.write_final(3))
    stored = load_file(str(Path(model_dir) / "model.safetensors"))
    result["same"] = all(torch.equal(p, stored[name]) for name, p in model.named_parameters())
    result["own"] = type(model).__module__.startswith("preftune.")
    Path(out, "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
