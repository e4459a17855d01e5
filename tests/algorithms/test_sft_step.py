"""SFT task: packed rows equal the padded layout (loss and gradients), attention does not cross
examples, micro-batch invariance with and without packing, end-to-end training and exact resume."""
from __future__ import annotations

import json
import os

import pytest
import torch

from preftune.algorithms.sft import SFTExample, SFTTask, example_logps
from preftune.model import logps as L
from preftune.config import load_config
from preftune.run import loop
from preftune.distributed.group import Parallel
from tests.conftest import arith_traces, flat_grads, write_parquet
from tests.run.test_resume import assert_same_run, overrides, train_until_preempted

CPU = torch.device("cpu")


class _Stop:
    def check(self):
        pass


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _examples(tokenizer, pairs):
    return [SFTExample(tokenizer(p).input_ids, tokenizer(c).input_ids + [tokenizer.eos_token_id]) for p, c in pairs]


PAIRS = [("12+7=", "19"), ("3+4=", "7"), ("10+19=", "29"), ("1+1=", "2"), ("0+0=", "0"), ("18+17=", "35")]


def test_packed_equals_padded_loss_and_gradients(tokenizer, model, monkeypatch):
    """Several examples in a row (attention kept within each) give one example per row's log-probs,
    entropies and gradients."""
    batch = _examples(tokenizer, PAIRS)
    out = {}
    for layout, masked in (("packed", 0.0), ("padded", 1e9)):
        monkeypatch.setattr(L, "MASKED", masked)
        rows = L.Rows.of([e.prompt for e in batch], [len(e.completion) for e in batch])
        plan = L._plan(rows, max(len(e.prompt) for e in batch), max(len(e.completion) for e in batch), model.config)
        assert (plan.rows < len(batch)) == (layout == "packed")  # several examples share a row
        lp, ent = example_logps(model, batch, tokenizer.pad_token_id, CPU)
        (-lp.sum()).backward()
        out[layout] = lp.detach(), ent, flat_grads(model).clone()
        model.zero_grad(set_to_none=True)
    (lp_pack, ent_pack, g_pack), (lp_pad, ent_pad, g_pad) = out["packed"], out["padded"]
    torch.testing.assert_close(lp_pack, lp_pad, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_pack, ent_pad, rtol=0, atol=1e-5)
    torch.testing.assert_close(g_pack, g_pad, rtol=0, atol=1e-5 * g_pad.abs().max().item())


def test_packing_false_keeps_one_example_per_row(tokenizer, model, monkeypatch):
    monkeypatch.setattr(L, "MASKED", 0.0)  # packing would always pay
    plans = []
    plan = L._plan
    monkeypatch.setattr(L, "_plan", lambda *a, **k: plans.append(plan(*a, **k)) or plans[-1])
    example_logps(model, _examples(tokenizer, PAIRS), tokenizer.pad_token_id, CPU, pack=False)
    assert plans[0].segment is None and plans[0].rows == len(PAIRS)


@pytest.fixture
def sft_cfg(make_config, tmp_path):
    traces = write_parquet(tmp_path / "traces.parquet", arith_traces(12))

    def make(*extra):
        return make_config("algorithm=sft", f"data.train={traces}", "sft.min_reward=0.0", "sft.batch_size=12",
                           "sft.micro_batch_size=12", "sft.max_length=24", "data.shuffle=false", *extra)

    return make


def _step(task, model, micro: int, packing: bool):
    task.stream.load_state_dict({"epoch": 0, "offset": 0})
    task.s.micro_batch_size, task.s.packing = micro, packing
    model.zero_grad(set_to_none=True)
    m = task.step(model, 1, _Stop())
    g = flat_grads(model).clone()
    model.zero_grad(set_to_none=True)
    return g, m


@pytest.mark.parametrize("packing", [False, True])
def test_micro_batch_invariance(sft_cfg, model, tokenizer, packing, monkeypatch):
    monkeypatch.setattr(L, "MASKED", 0.0 if packing else 1e9)
    task = SFTTask(sft_cfg(), model, tokenizer, CPU, dp=Parallel())
    assert len(task.encoded) == 48  # min_reward 0: every trace row is an example
    full, m_full = _step(task, model, 12, False)
    assert full.abs().max() > 0
    for micro in (1, 5):  # one example at a time, and uneven (5 + 5 + 2)
        part, m_part = _step(task, model, micro, packing)
        torch.testing.assert_close(part, full, rtol=0, atol=1e-5 * full.abs().max().item())
        assert m_part["loss"] == pytest.approx(m_full["loss"], rel=1e-5)
        assert m_part["entropy"] == pytest.approx(m_full["entropy"], rel=1e-5)
        assert m_part["num_tokens"] == m_full["num_tokens"]


def test_data_report_and_min_reward(sft_cfg, model, tokenizer):
    cfg = sft_cfg("sft.min_reward=0.7")
    task = SFTTask(cfg, model, tokenizer, CPU, dp=Parallel())
    assert len(task.encoded) == 12  # only the right answers
    report = task.data_report  # the loop writes it to data_report.json once setup has succeeded
    assert not os.path.exists(cfg.output_dir)  # the task itself writes nothing
    assert report["sft"] == {"examples": 12, "below_min_reward": 36}
    assert report["encoded"]["examples"] == 12 and report["encoded"]["completions_truncated"] == 0


def test_sft_training_lowers_the_loss_on_its_examples(sft_cfg):
    cfg = sft_cfg("sft.min_reward=0.7", "max_steps=15", "optim.lr=1e-3", "optim.lr_scheduler=constant")
    loop.train(cfg)
    rows = [json.loads(x) for x in open(f"{cfg.output_dir}/metrics.jsonl")]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 15 and losses[-1] < 0.7 * losses[0]
    assert os.path.isfile(f"{cfg.output_dir}/final/model.safetensors")


def test_interrupted_and_resumed_sft_run_equals_uninterrupted(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    sft = ["algorithm=sft", "sft.batch_size=4", "sft.micro_batch_size=2", "sft.max_length=24", "sft.min_reward=0.0"]
    ref = tmp_path / "ref"
    loop.train(load_config(None, overrides("dpo", ref, data) + sft))
    ovr = overrides("dpo", tmp_path / "run", data) + sft
    assert "preempted at step 1;" in train_until_preempted(ovr, monkeypatch, 1, "after")
    assert "preempted at step 3;" in train_until_preempted(ovr, monkeypatch, 3, "after")
    loop.train(load_config(None, ovr))
    assert_same_run(ref, tmp_path / "run")


def test_the_example_config_trains(tmp_path):
    from tests.conftest import EXAMPLES

    cfg = load_config(EXAMPLES / "sft.yaml", [f"output_dir={tmp_path / 'run'}", "max_steps=2", "eval.eval_steps=0",
                                              "log.progress_bar=false", "data.eval=null"])
    assert cfg.algorithm == "sft" and cfg.sft.min_reward == 1.0
    loop.train(cfg)
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["format"] == "traces" and report["sft"]["examples"] == 262  # the correct responses


def test_messages_and_prompt_completion_of_the_same_examples_train_the_same(tmp_path):
    """Through the Python API with in-memory rows: the conversational form renders (chat template) to
    the same tokens as the prompt/completion form, so the losses match step for step."""
    import preftune
    from tests.conftest import EXAMPLES

    pc = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(5) for b in range(5)]
    msgs = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]}
            for r in pc]
    losses = {}
    for name, rows in (("pc", pc), ("messages", msgs)):
        r = preftune.train(EXAMPLES / "sft.yaml", train_data=rows,
                           overrides={"output_dir": str(tmp_path / name), "max_steps": 3, "log.progress_bar": False,
                                      "data.eval": None})
        report = json.loads((tmp_path / name / "data_report.json").read_text())
        assert report["format"] == {"pc": "prompt_completion", "messages": "messages"}[name]
        losses[name] = [x["loss"] for x in map(json.loads, r.metrics_path.read_text().splitlines()) if "loss" in x]
    assert len(losses["pc"]) == 3 and losses["pc"] == losses["messages"]
