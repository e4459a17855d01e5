"""No run reads memory it did not write. With every unfilled float allocation NaN (`nan_memory`,
as an old heap can leave it), each algorithm ends with the weights and metrics of a run on clean
memory. Both bugs of this kind were found by CI only when its heap happened to hold NaN: an
uninitialised embedding, and the sampler's unwritten cache columns."""
from __future__ import annotations

import pytest
import torch

from preftune.config import load_config
from preftune.run import loop
from tests.run.test_resume import assert_same_run, data_dir, overrides  # noqa: F401 - fixture


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("kind, extra", [
    ("online", {"grpo.beta": 0.04}),  # the reference model too
    ("dpo", {}), ("kto", {}), ("sft", {}),
])
def test_nan_in_unwritten_memory_changes_nothing(kind, extra, data_dir, tmp_path, nan_memory):
    run = {"max_steps": 3, "save_steps": 2, **extra}
    loop.train(load_config(None, overrides(kind, tmp_path / "clean", data_dir, **run)))
    nan_memory()
    loop.train(load_config(None, overrides(kind, tmp_path / "nan", data_dir, **run)))
    assert_same_run(tmp_path / "clean", tmp_path / "nan")
