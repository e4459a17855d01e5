"""Less work, same update (float64): packed rows with each prompt once, and skipped zero-advantage
rows, give the gradients and losses of the plain per-row computation, for every loss type, with
and without a reference model; DPO pairs and LoRA too."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from preftune.algorithms.grpo import GRPOBatch, grpo_step, rollout_logps, trained_rows
from preftune.config import GRPOConfig
from preftune.model import llama as D, logps as L, ops
from preftune.distributed.group import Parallel
from tests.conftest import MODEL_DIR
from tests.model.test_logps import LAYOUTS
from tests.algorithms.test_grpo_step import N, T, perturbed, run_step, synthetic_rollout

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


@pytest.fixture(scope="module")
def setup(tokenizer):
    """A float64 model (RMSNorm in float64: HF's computes in float32 even then, which would cap any
    comparison of summation orders at float32 rounding), and a batch with old and reference
    log-probs from perturbed copies."""
    from transformers import AutoConfig

    mp = pytest.MonkeyPatch()
    mp.setattr(ops, "rms", lambda x, w, eps: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)))
    model = D.Llama.from_pretrained(MODEL_DIR, AutoConfig.from_pretrained(str(MODEL_DIR)), dtype=torch.float64)
    ro = synthetic_rollout(tokenizer)
    cfg = GRPOConfig(micro_batch_size=N)
    ro.old_logps = rollout_logps(perturbed(model, 0.03, seed=1), ro, cfg)
    ref = rollout_logps(perturbed(model, 0.02, seed=2), ro, cfg)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    yield model, GRPOBatch(rollout=ro, advantages=adv, ref_logps=ref)
    mp.undo()


def _cfg(loss_type, **kw):
    kw = {"micro_batch_size": N} | kw
    return GRPOConfig(loss_type=loss_type, max_completion_length=T,
                      epsilon_high=5.0 if loss_type == "cispo" else None, **kw)


def _compare(a, b, ma, mb):
    torch.testing.assert_close(a, b, rtol=0, atol=1e-10 * b.abs().max().item())
    for k in ("loss", "kl", "entropy", "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max"):
        assert ma[k] == pytest.approx(mb[k], rel=1e-9, abs=1e-12, nan_ok=True), k


def test_prompt_groups_are_runs_of_equal_prompts():
    ids = torch.tensor([[0, 5], [0, 5], [9, 5], [7, 7], [7, 7], [7, 7]])
    mask = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 1], [1, 1], [1, 1]])
    # rows 0-2: the same real prompt (5), different padding ids; then one prompt three times
    cmask = torch.ones(6, 3, dtype=torch.long)
    cmask[1, 2:] = 0
    rows = L.Rows.read(ids, mask, cmask)
    assert rows.units() == [[0, 1, 2], [3, 4, 5]] and rows.prompt == [1, 1, 1, 2, 2, 2]
    assert rows.completion == [3, 2, 3, 3, 3, 3] and rows[2:4].units() == [[0], [1]]
    assert rows[[0, 2, 3]].units() == [[0, 1], [2]]  # picked rows keep their runs
    assert rows.width == 5
    # built on the host from token lists: the same runs
    assert L.Rows.of([[5], [5], [5], [7, 7], [7, 7], [7, 7]], [3, 2, 3, 3, 3, 3]) == rows


def test_packed_layout_equals_plain_rows(setup, monkeypatch):
    """Log-probs, entropy and their gradient: each prompt once in packed rows == plain rows, to
    float64 rounding."""
    model, batch = setup
    ro = batch.rollout
    out = {}
    for layout, masked in LAYOUTS.items():
        monkeypatch.setattr(L, "MASKED", masked)
        model.zero_grad(set_to_none=True)
        lp, ent = L.completion_logps(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                     ro.completion_mask, temperature=0.7, with_entropy=True)
        (lp * ro.completion_mask).sum().backward()
        out[layout] = (lp.detach(), ent, torch.cat([p.grad.flatten() for p in model.parameters()]))
    m = ro.completion_mask.bool()
    for x, y in zip(out["packed"][:2], out["plain"][:2]):
        torch.testing.assert_close(x[m], y[m], rtol=0, atol=1e-12)
    g = out["plain"][2]
    torch.testing.assert_close(out["packed"][2], g, rtol=0, atol=1e-11 * g.abs().max().item())


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_shared_prompt_step_equals_unshared(setup, loss_type, beta, monkeypatch):
    """The whole GRPO step (micro-batches that cut groups in two included), with and without KL."""
    model, batch = setup
    cfg = _cfg(loss_type, beta=beta)
    if beta == 0:
        batch = dataclasses.replace(batch, ref_logps=None)
    for mb in (N, 5):
        monkeypatch.setattr(L, "MASKED", LAYOUTS["packed"])
        shared, m_shared = run_step(model, batch, dataclasses.replace(cfg, micro_batch_size=mb))
        monkeypatch.setattr(L, "MASKED", LAYOUTS["plain"])
        plain, m_plain = run_step(model, batch, dataclasses.replace(cfg, micro_batch_size=mb))
        _compare(shared, plain, m_shared, m_plain)


def test_reference_pass_shares_prompts(setup, monkeypatch):
    model, batch = setup
    cfg = GRPOConfig(micro_batch_size=5)
    monkeypatch.setattr(L, "MASKED", LAYOUTS["packed"])
    shared = rollout_logps(model, batch.rollout, cfg)
    assert not shared.requires_grad  # no autograd state in the reference pass
    monkeypatch.setattr(L, "MASKED", LAYOUTS["plain"])
    plain = rollout_logps(model, batch.rollout, cfg)
    m = batch.rollout.completion_mask.bool()
    torch.testing.assert_close(shared[m], plain[m], rtol=0, atol=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_zero_advantage_rows_skipped_same_update(setup, loss_type, level, monkeypatch):
    """beta = 0: rows with advantage 0 (two whole groups here, as when all rewards are equal) are not
    run, and the gradient, loss and metrics equal those of running them."""
    import preftune.algorithms.grpo as grpo

    model, batch = setup
    adv = batch.advantages.clone()
    adv[0:3] = 0.0
    adv[6:9] = 0.0
    batch = dataclasses.replace(batch, advantages=adv, ref_logps=None)
    cfg = _cfg(loss_type, importance_sampling_level=level, micro_batch_size=4)
    skipped, m_skip = run_step(model, batch, cfg)
    assert m_skip["rows_skipped"] == 6
    monkeypatch.setattr(grpo, "trained_rows", lambda *a: None)
    full, m_full = run_step(model, batch, cfg)
    assert m_full["rows_skipped"] == 0
    m_full["entropy"] = m_skip["entropy"]  # entropy is reported over the rows run
    _compare(skipped, full, m_skip, m_full)


def test_no_row_skipped_with_kl_and_empty_rows_always(setup):
    _, batch = setup
    adv = torch.tensor([0.0, 1.0, 0.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    assert trained_rows(adv, mask, beta=0.0).tolist() == [3]
    assert trained_rows(adv, mask, beta=0.1).tolist() == [0, 2, 3]  # only the row without tokens
    assert trained_rows(adv, torch.ones(4, 2), beta=0.1) is None


def test_all_rows_skipped_still_gives_zero_gradients(setup):
    """A batch of equal rewards: nothing runs, but every parameter gets a zero gradient, so the
    optimiser steps (momentum, weight decay) exactly as it would after a zero-gradient pass."""
    model, batch = setup
    batch = dataclasses.replace(batch, advantages=torch.zeros(N, dtype=torch.float64), ref_logps=None)
    model.zero_grad(set_to_none=True)
    m = grpo_step(model, batch, _cfg("dapo"), dp=Parallel())
    assert m["rows_skipped"] == N and m["loss"] == 0.0 and m["clip_ratio/region_mean"] == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    model.zero_grad(set_to_none=True)


def test_dpo_pairs_share_their_prompt(setup, tokenizer, monkeypatch):
    """DPO: chosen and rejected as branches of one prompt pass; the summed log-probs and their
    gradient equal plain rows."""
    from preftune.algorithms.dpo import EncodedPair, sequence_logps

    model, _ = setup
    g = torch.Generator().manual_seed(5)
    toks = lambda n: torch.randint(3, 200, (n,), generator=g).tolist()  # noqa: E731
    pairs = [EncodedPair(toks(2 + 7 * (i % 3)), toks(1 + i % 5), toks(1 + (3 * i) % 11)) for i in range(10)]

    def run(layout: str):
        monkeypatch.setattr(L, "MASKED", LAYOUTS[layout])
        model.zero_grad(set_to_none=True)
        lp, lengths = sequence_logps(model, pairs, tokenizer.pad_token_id, "cpu")
        (lp * torch.linspace(-1, 1, lp.numel(), dtype=lp.dtype)).sum().backward()
        return lp.detach(), lengths, torch.cat([p.grad.flatten() for p in model.parameters()])

    want, got = run("plain"), run("packed")
    assert want[1].tolist() == [len(p.chosen) for p in pairs] + [len(p.rejected) for p in pairs]
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-11)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=1e-11 * want[2].abs().max().item())


def test_shared_prompts_with_lora_and_its_reference(tokenizer, monkeypatch):
    """LoRA: the adapters' gradients, and the reference pass with adapters disabled, agree too."""
    from preftune.config import LoraConfig, ModelConfig
    from preftune.model.load import load_model

    model = load_model(ModelConfig(lora=LoraConfig(enabled=True, r=4, dropout=0.0)), str(MODEL_DIR))
    with torch.no_grad():  # non-zero B matrices, so the adapters change the outputs
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    ro = synthetic_rollout(tokenizer)
    out = []
    for layout in ("packed", "plain"):
        monkeypatch.setattr(L, "MASKED", LAYOUTS[layout])
        model.zero_grad(set_to_none=True)
        lp, _ = L.completion_logps(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
        (lp * ro.completion_mask).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        ref = rollout_logps(model, ro, GRPOConfig(), without_adapter=True)
        out.append((lp.detach(), grads, ref))
    m = ro.completion_mask.bool()
    (a, ga, ra), (b, gb, rb) = out
    torch.testing.assert_close(a[m], b[m], rtol=0, atol=2e-5)
    torch.testing.assert_close(ra[m], rb[m], rtol=0, atol=2e-5)
    assert not torch.allclose(a[m], ra[m], atol=1e-3)  # the adapters were on for the policy, off for the reference
    torch.testing.assert_close(ga, gb, rtol=0, atol=1e-5 * gb.abs().max().item())
