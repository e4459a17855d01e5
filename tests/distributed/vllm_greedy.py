"""Run on each of 2 gloo ranks by tests/rollout/test_vllm.py: an FSDP2 policy and one vLLM engine
per rank. Greedy completions of the engine and of the own sampler from the same weights, before
training, after a few optimiser steps without a push, and after the push; each rank writes them
as JSON."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from transformers import AutoTokenizer

from preftune.config import load_config
from preftune.distributed import fsdp
from preftune.distributed.group import init
from preftune.rollout.vllm import VLLMEngine
from tests.conftest import MODEL_DIR, TRAIN_PROMPTS
from tests.rollout.test_vllm import _completions, _engine_greedy, _own_greedy, _train


def main(out: Path) -> None:
    cfg = load_config(None, [f"model.name_or_path={MODEL_DIR}", f"data.train={TRAIN_PROMPTS}", "grpo.use_vllm=true",
                             "distributed.strategy=fsdp"])
    dp = init(cfg.distributed)
    model, tok = fsdp.load(dp, cfg.model, cfg.model.name_or_path), AutoTokenizer.from_pretrained(MODEL_DIR)
    engine = VLLMEngine(cfg.grpo, cfg.model, max_model_len=64, seed=0, dp=dp)
    engine.push(model)
    seen = {"before_engine": _completions(_engine_greedy(engine, tok)),
            "before_own": _completions(_own_greedy(model, tok))}
    _train(model, tok)  # FSDP2 steps: each rank updates its shards
    seen["stale_engine"] = _completions(_engine_greedy(engine, tok))
    seen["after_own"] = _completions(_own_greedy(model, tok))
    engine.push(model)  # every rank gathers every parameter, in the same order
    seen["after_engine"] = _completions(_engine_greedy(engine, tok))
    (out / f"rank{dp.rank}.json").write_text(json.dumps(seen))
    dp.barrier()
    os._exit(0)  # vLLM's engine and its process group: no teardown at interpreter exit


if __name__ == "__main__":
    main(Path(sys.argv[1]))
