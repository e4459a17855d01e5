"""KTO task: labels and the data report, fixed batches with TRL's mismatched pairs, the step equal to
kto_loss on the whole batch (and micro-batch invariant), the reference log-prob cache, TRL's weight advice."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import preftune.algorithms.kto as kto_mod
from preftune.algorithms.kto import KTOTask, fixed_batches, summed_logps
from preftune.errors import UserError
from preftune.losses import kto_loss
from preftune.distributed.group import Parallel
from tests.conftest import flat_grads, write_parquet

CPU = torch.device("cpu")


class _Stop:
    def check(self):
        pass


def make_task(cfg, model, tokenizer) -> KTOTask:
    task = KTOTask(cfg, model, tokenizer, CPU, dp=Parallel())
    task.prepare(model)
    return task


def _cfg(make_config, traces_file, *overrides):
    return make_config("algorithm=kto", f"data.train={traces_file}", "kto.batch_size=6", "kto.micro_batch_size=6",
                       "data.rejected_max=0.3", *overrides)


def _shift(model, scale=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def _step(task, model, micro: int):
    task.stream.load_state_dict({"epoch": 0, "offset": 0})
    task.k.micro_batch_size = micro
    model.zero_grad(set_to_none=True)
    m = task.step(model, 1, _Stop())
    g = flat_grads(model).clone()
    model.zero_grad(set_to_none=True)
    return g, m


# ---------------------------------------------------------------- labels, report, batches


def test_labels_and_data_report_count_every_trace(make_config, traces_file, model, tokenizer):
    # arith_traces: per prompt 1.0 and three wrong answers 0.4 e^{-d/3}, d = 1, 3, 10: 0.287, 0.147, 0.014.
    # rejected_max 0.3: all wrong ones undesirable; 0.15: the d = 1 one (0.287) is between the thresholds.
    task = KTOTask(_cfg(make_config, traces_file, "data.rejected_max=0.15"), model, tokenizer, CPU, dp=Parallel())
    r = task.data_report
    assert r["traces"]["kept"] == 24
    assert r["kto"] == {"examples": 18, "desirable": 6, "undesirable": 12, "between_thresholds": 6}
    assert r["encoded"]["examples"] == 18 and r["encoded"]["desirable"] == 6
    assert sorted(e.desirable for e in task.encoded) == [False] * 12 + [True] * 6
    with pytest.raises(UserError, match="no KTO example to train on: all 24 rows"):
        KTOTask(_cfg(make_config, traces_file, "data.chosen_min=2", "data.rejected_max=0.0"), model, tokenizer, CPU, dp=Parallel())


def test_fixed_batches_rotate_completions_like_trl():
    slots = fixed_batches(7, 3, seed=0, shuffle=False)  # 3 batches of 3: the last filled from the next epoch
    examples = [e for e, _ in slots]
    assert examples == [0, 1, 2, 3, 4, 5, 6, 0, 1]
    # TRL: KL_completion_ids = [c[-1]] + c[:-1] within each batch
    assert [p for _, p in slots] == [2, 0, 1, 5, 3, 4, 1, 6, 0]
    shuffled = fixed_batches(7, 3, seed=0, shuffle=True)
    assert sorted(e for e, _ in shuffled[:7]) == list(range(7)) and shuffled == fixed_batches(7, 3, 0, True)
    assert fixed_batches(2, 4, 0, False) == [(0, 1), (1, 0), (0, 1), (1, 0)]  # fewer examples than a batch


def test_batch_size_one_is_refused_for_kto(make_config, traces_file, model, tokenizer):
    with pytest.raises(UserError, match="kto.batch_size"):
        KTOTask(_cfg(make_config, traces_file, "kto.batch_size=1"), model, tokenizer, CPU, dp=Parallel())
    KTOTask(_cfg(make_config, traces_file, "kto.batch_size=1", "kto.loss_type=apo_zero_unpaired"), model,
            tokenizer, CPU, dp=Parallel())


def test_trl_weight_advice_is_logged(make_config, traces_file, model, tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="preftune"):
        KTOTask(_cfg(make_config, traces_file), model, tokenizer, CPU, dp=Parallel())  # 6 desirable, 18 undesirable
    assert "kto.desirable_weight in [3.0, 3.99]" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="preftune"):
        KTOTask(_cfg(make_config, traces_file, "kto.desirable_weight=3.5"), model, tokenizer, CPU, dp=Parallel())
    assert "weighted ratio" not in caplog.text


# ---------------------------------------------------------------- the step


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_step_is_kto_loss_on_the_whole_batch(make_config, traces_file, model, tokenizer, loss_type):
    """The step's loss and gradient are kto_loss of the batch's examples with the mismatched pairs
    (x_k, y_{k-1}) giving z, all under the initial policy as reference; and the same in micro-batches."""
    cfg = _cfg(make_config, traces_file, f"kto.loss_type={loss_type}", "kto.desirable_weight=1.5",
               "data.shuffle=false")
    task = make_task(cfg, model, tokenizer)
    assert len(task.encoded) == 24 and task.ref.shape == (24, 2 if loss_type == "kto" else 1)
    batch = task.encoded[:6]  # unshuffled: the first batch is the first 6 examples
    pad = tokenizer.pad_token_id
    mismatched = [(e.prompt, batch[k - 1].completion[:cfg.kto.max_length - len(e.prompt)]) for k, e in enumerate(batch)]
    with torch.no_grad():
        model.eval()
        ref = summed_logps(model, [(e.prompt, e.completion) for e in batch], pad, CPU)
        ref_kl = summed_logps(model, mismatched, pad, CPU)
        model.train()
    torch.testing.assert_close(task.ref[:6, 0], ref, rtol=0, atol=1e-4)
    if loss_type == "kto":
        torch.testing.assert_close(task.ref[:6, 1], ref_kl, rtol=0, atol=1e-4)
    _shift(model)
    if loss_type == "kto":  # a random shift makes every log-ratio negative (z = 0): lower the reference's
        task.ref[:, 1] -= 3.0  # mismatched log-probs so that z > 0 and takes part
    labels = torch.tensor([e.desirable for e in batch])
    assert labels.any() and not labels.all()
    lp = summed_logps(model, [(e.prompt, e.completion) for e in batch], pad, CPU)
    with torch.no_grad():
        kl = summed_logps(model, mismatched, pad, CPU)
    want, wm = kto_loss(lp, task.ref[:6, 0], labels, kl, task.ref[:6, -1], beta=0.1, desirable_weight=1.5,
                        loss_type=loss_type)
    model.zero_grad(set_to_none=True)
    want.backward()
    want_g = flat_grads(model).clone()
    full, m = _step(task, model, 6)
    assert m["loss"] == pytest.approx(want.item(), rel=1e-5)
    torch.testing.assert_close(full, want_g, rtol=0, atol=1e-5 * want_g.abs().max().item())
    assert m.keys() >= wm.keys() and m == pytest.approx(m | wm, rel=1e-4, abs=1e-6)
    if loss_type == "kto":
        assert 0.1 < m["kl"] < 3.0  # z in play, not clamped
    for micro in (1, 4):  # one example at a time, and uneven (4 + 2)
        part, m_part = _step(task, model, micro)
        torch.testing.assert_close(part, full, rtol=0, atol=1e-5 * full.abs().max().item())
        assert m_part == pytest.approx(m, rel=1e-5, abs=1e-7)


def test_reference_logps_cached_and_reused(make_config, traces_file, model, tokenizer, monkeypatch):
    cfg = _cfg(make_config, traces_file)
    task = make_task(cfg, model, tokenizer)
    saved = torch.load(Path(cfg.output_dir) / "ref_logps.pt", weights_only=True)
    assert torch.equal(saved["logps"], task.ref)
    calls = []
    real = kto_mod.summed_logps
    monkeypatch.setattr(kto_mod, "summed_logps", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = make_task(cfg, model, tokenizer)
    assert calls == [] and torch.equal(again.ref, task.ref)
    other = make_task(_cfg(make_config, traces_file, "seed=1"), model, tokenizer)  # other batches: other pairs
    assert calls and not torch.equal(other.ref, task.ref)
    state = other.state_dict()  # a checkpoint carries them: a resumed task runs no reference pass
    calls.clear()
    resumed = KTOTask(_cfg(make_config, traces_file, "seed=1"), model, tokenizer, CPU, dp=Parallel())
    resumed.load_state_dict(state)
    resumed.prepare(model)
    assert calls == [] and torch.equal(resumed.ref, other.ref)


def test_traces_with_chat_prompts(make_config, tmp_path, model, tokenizer):
    rows = [{"input": [{"role": "user", "content": f"{i}+1="}], "output": str(i + 1 + (i % 2)),
             "final_reward": 1.0 - (i % 2)} for i in range(8)]
    path = write_parquet(tmp_path / "chat.parquet", rows)
    if not getattr(tokenizer, "chat_template", None):
        pytest.skip("the embedded tokenizer has no chat template")
    task = make_task(_cfg(make_config, path, "kto.batch_size=4", "kto.micro_batch_size=4"), model, tokenizer)
    m = task.step(model, 1, _Stop())
    assert m["rewards/chosen"] == pytest.approx(0.0, abs=1e-5) and 0 <= m["kl"] < 1e-4


def test_a_batch_that_does_not_split_over_the_ranks_is_refused(make_config, traces_file):
    from preftune.distributed.group import Parallel
    from preftune.run.loop import check_parallel

    with pytest.raises(UserError, match="kto.batch_size"):
        check_parallel(_cfg(make_config, traces_file, "kto.batch_size=5"), Parallel(rank=0, world=2))
    check_parallel(_cfg(make_config, traces_file, "kto.batch_size=6"), Parallel(rank=0, world=2))
