"""GRPO training step: completion log-probs, micro-batch (gradient accumulation) invariance on a real model,
old/reference log-probs, advantages for uneven groups, masking, dynamic sampling, batch reuse."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from preftune.algorithms.grpo import GRPOBatch, grpo_step, new_batch, rollout_logps
from preftune.config import GRPOConfig
from preftune.data.prompts import PromptSet
from preftune.data.tensors import left_pad, right_pad
from preftune.data.tokenize import PromptTruncation
from preftune.losses.advantages import group_advantages
from preftune.model.logps import completion_logps
from preftune.rollout.online import OnlineSource
from preftune.rollout.sampler import Rollout
from preftune.rollout.scored import Scored
from preftune.distributed.group import Parallel
from tests.conftest import HostReads, flat_grads

PROMPTS = ["12+7=", "3+4=", "19+19=", "0+0="]
G, T = 3, 6  # generations per prompt, completion width
N = len(PROMPTS) * G


def synthetic_rollout(tokenizer, seed: int = 0) -> Rollout:
    """Left-padded prompts of different lengths, random completions of random lengths; every 4th row
    is truncated (no EOS, full width), the others end in EOS and are right-padded."""
    g = torch.Generator().manual_seed(seed)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    comps, truncated = [], []
    for i in range(N):
        cut = i % 4 == 0
        length = T if cut else int(torch.randint(1, T + 1, (1,), generator=g))
        toks = torch.randint(3, 100, (length,), generator=g).tolist()
        if not cut:
            toks[-1] = eos
        comps.append(toks)
        truncated.append(cut)
    p_ids, p_mask = left_pad([prompts[i // G] for i in range(N)], pad)
    c_ids, c_mask = right_pad(comps, pad)
    return Rollout(p_ids, p_mask, c_ids, c_mask, torch.tensor(truncated))


def perturbed(model, scale: float, seed: int):
    """A copy of `model` with noisy weights (an 'old' policy or a reference that differs from it)."""
    import copy

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return other.eval().requires_grad_(False)


def run_step(model, batch, cfg):
    model.zero_grad(set_to_none=True)
    m = grpo_step(model, batch, cfg, dp=Parallel())
    grads = flat_grads(model).clone()
    model.zero_grad(set_to_none=True)
    return grads, m


# ---------------------------------------------------------------- completion log-probs


def test_completion_logps_padding_invariant(model, hf_model, tokenizer):
    """Each row's log-probs equal a plain forward of the Hugging Face module + log_softmax over its
    unpadded prompt+completion."""
    ro = synthetic_rollout(tokenizer)
    model.eval()
    for temperature in (1.0, 0.7):
        with torch.no_grad():
            logps, ent = completion_logps(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                          ro.completion_mask, temperature=temperature, with_entropy=True)
        assert logps.shape == ent.shape == ro.completion_ids.shape
        for i in range(N):
            p = ro.prompt_ids[i][ro.prompt_mask[i].bool()]
            c = ro.completion_ids[i][ro.completion_mask[i].bool()]
            seq = torch.cat([p, c])[None]  # (1, L)
            with torch.no_grad():
                logits = hf_model(input_ids=seq).logits[0, len(p) - 1:-1].float() / temperature  # (|c|, V)
            ref = logits.log_softmax(-1)
            want = ref.gather(-1, c[:, None]).squeeze(-1)
            want_ent = -(ref.exp() * ref).sum(-1)
            torch.testing.assert_close(logps[i, :len(c)], want, rtol=0, atol=2e-5)
            torch.testing.assert_close(ent[i, :len(c)], want_ent, rtol=0, atol=2e-5)
    assert (ent >= 0).all()


def test_completion_logps_without_entropy_has_grad(model, tokenizer):
    ro = synthetic_rollout(tokenizer)
    logps, ent = completion_logps(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    assert ent is None and logps.requires_grad and (logps <= 0).all()


# ---------------------------------------------------------------- micro-batch invariance


def _batch(model, tokenizer, cfg: GRPOConfig) -> GRPOBatch:
    ro = synthetic_rollout(tokenizer)
    # an old policy a little off the current one, so ratios leave [1 - eps, 1 + eps] and clipping acts
    ro.old_logps = rollout_logps(perturbed(model, 0.03, seed=1), ro, cfg)
    ref = rollout_logps(perturbed(model, 0.02, seed=2), ro, cfg) if cfg.beta > 0 else None
    adv = torch.randn(N, generator=torch.Generator().manual_seed(3))
    return GRPOBatch(rollout=ro, advantages=adv, ref_logps=ref)


@pytest.fixture(scope="module")
def shared(tokenizer):
    """One model and one batch (with old and reference log-probs) for all the invariance cases:
    grpo_step only accumulates gradients, it never changes the weights."""
    from preftune.config import ModelConfig
    from preftune.model.load import load_model
    from tests.conftest import MODEL_DIR

    model = load_model(ModelConfig(), str(MODEL_DIR))
    return model, _batch(model, tokenizer, GRPOConfig(beta=0.04, micro_batch_size=N))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_gradient_accumulation_invariance(shared, loss_type, level):
    model, batch = shared
    cfg = GRPOConfig(loss_type=loss_type, importance_sampling_level=level, beta=0.04, micro_batch_size=N,
                     max_completion_length=T, epsilon_high=5.0 if loss_type == "cispo" else None)
    full, m_full = run_step(model, batch, cfg)
    scale = full.abs().max().item()
    assert scale > 0
    if loss_type in ("grpo", "dapo"):
        assert m_full["clip_ratio/region_mean"] > 0 and m_full["kl"] > 0  # both branches exercised
    for mb in (N // 4, 5, 1):  # even, uneven (5, 5, 2) and one row at a time
        part, m_part = run_step(model, batch, dataclasses.replace(cfg, micro_batch_size=mb))
        torch.testing.assert_close(part, full, rtol=0, atol=1e-5 * scale, msg=f"micro_batch_size={mb}")
        assert m_part["loss"] == pytest.approx(m_full["loss"], rel=1e-5, abs=1e-7)
        assert m_part["entropy"] == pytest.approx(m_full["entropy"], rel=1e-5)
        # token means (GSPO: sequence means for the clip ratios) must combine to the one-pass value
        for k in ("kl", "clip_ratio/region_mean", "clip_ratio/high_mean", "clip_ratio/low_mean"):
            assert m_part[k] == pytest.approx(m_full[k], rel=1e-5, abs=1e-7), k
        for k in ("clip_ratio/high_max", "clip_ratio/low_min"):
            if not math.isnan(m_full[k]):
                assert m_part[k] == pytest.approx(m_full[k], abs=1e-6), k
        if loss_type == "vespo":  # a mean over sequences
            assert m_part["vespo/phi_seq_mean"] == pytest.approx(m_full["vespo/phi_seq_mean"], rel=1e-5)


def test_mask_truncated_completions_removes_truncated_rows(model, tokenizer):
    cfg = GRPOConfig(loss_type="dapo", beta=0.04, micro_batch_size=5, max_completion_length=T,
                     mask_truncated_completions=True)
    batch = _batch(model, tokenizer, cfg)
    cut = batch.rollout.truncated
    assert cut.any() and not cut.all()
    base, _ = run_step(model, batch, cfg)
    # changing the truncated rows' advantages (and their reference) must not change anything
    other = dataclasses.replace(batch, advantages=torch.where(cut, 100.0, batch.advantages),
                                ref_logps=torch.where(cut[:, None], -50.0, batch.ref_logps))
    masked, _ = run_step(model, other, cfg)
    torch.testing.assert_close(masked, base, rtol=0, atol=1e-6 * base.abs().max().item())
    unmasked, _ = run_step(model, other, dataclasses.replace(cfg, mask_truncated_completions=False))
    assert not torch.allclose(unmasked, base, atol=1e-3 * base.abs().max().item())


# ---------------------------------------------------------------- old / reference log-probs


def _scored(ro: Rollout, rewards: list[float], sizes: list[int]) -> Scored:
    total = torch.tensor(rewards)
    return Scored(ro, total[:, None].clone(), total, ["r"], sizes)


def test_old_logps_are_recorded_by_the_first_step_of_a_reused_batch(model, tokenizer):
    ro = synthetic_rollout(tokenizer)
    rewards = torch.rand(N, generator=torch.Generator().manual_seed(0)).tolist()
    cfg = GRPOConfig(num_iterations=1, beta=0.0, micro_batch_size=5, max_completion_length=T)
    b1 = new_batch(_scored(ro, rewards, [G] * 4), model, None, cfg, dp=Parallel())
    assert b1.rollout.old_logps is None and b1.ref_logps is None
    run_step(model, b1, cfg)
    assert b1.rollout.old_logps is None  # used once: nothing to record
    ro2 = synthetic_rollout(tokenizer)
    cfg2 = dataclasses.replace(cfg, num_iterations=2, beta=0.1)
    ref_model = perturbed(model, 0.02, seed=5)
    b2 = new_batch(_scored(ro2, rewards, [G] * 4), model, ref_model, cfg2, dp=Parallel())
    assert b2.rollout.old_logps is None  # no pass of its own
    assert b2.ref_logps.shape == (N, ro2.completion_ids.size(1))
    with torch.no_grad():
        want_old, _ = completion_logps(model, ro2.prompt_ids, ro2.prompt_mask, ro2.completion_ids,
                                       ro2.completion_mask)
        want_ref, _ = completion_logps(ref_model, ro2.prompt_ids, ro2.prompt_mask, ro2.completion_ids,
                                       ro2.completion_mask)
    m = ro2.completion_mask.bool()
    torch.testing.assert_close(b2.ref_logps[m], want_ref[m], rtol=0, atol=1e-5)
    assert b2.metrics["reward"] == pytest.approx(sum(rewards) / N)
    # the first step trains on-policy (ratio 1) and records the sampling policy's log-probs
    g_first, m_first = run_step(model, b2, dataclasses.replace(cfg2, beta=0.0))
    assert m_first["clip_ratio/region_mean"] == 0.0
    torch.testing.assert_close(b2.rollout.old_logps[m], want_old[m], rtol=0, atol=1e-5)
    # a later step reads them: with unchanged weights it is the same on-policy gradient
    g_later, _ = run_step(model, b2, dataclasses.replace(cfg2, beta=0.0))
    torch.testing.assert_close(g_first, g_later, rtol=0, atol=1e-5 * g_first.abs().max().item())


def test_batch_state_dict_round_trip(tokenizer):
    ro = synthetic_rollout(tokenizer)
    ro.old_logps = torch.randn(ro.completion_ids.shape)
    ro.sampling_logps = torch.randn(ro.completion_ids.shape)
    ro.tool_mask = (torch.rand(ro.completion_ids.shape) > 0.2).long()  # an agent rollout's
    # a mixture of experts' routes (N, P+T, S, k)
    ro.routes = torch.randint(-1, 4, (N, ro.prompt_ids.size(1) + ro.completion_ids.size(1), 2, 2),
                              dtype=torch.int16)
    b = GRPOBatch(ro, torch.randn(N), torch.randn(ro.completion_ids.shape), {"reward": 0.5},
                  is_weights=torch.rand(N, 1))
    again = GRPOBatch.from_state_dict(b.state_dict())
    for k in Rollout.__slots__:
        assert torch.equal(getattr(again.rollout, k), getattr(ro, k)), k
    assert torch.equal(again.advantages, b.advantages) and torch.equal(again.ref_logps, b.ref_logps)
    assert torch.equal(again.is_weights, b.is_weights)
    assert again.metrics == {"reward": 0.5}


# ---------------------------------------------------------------- advantages


def advantages(s, scale: str):
    """What new_batch computes: one function for equal and unequal (offline) groups."""
    return group_advantages(s.total, s.group_sizes, scale_rewards=scale)


def _std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def test_advantages_unequal_groups_by_hand(tokenizer):
    ro = synthetic_rollout(tokenizer)
    groups = [[1.0, 0.0, 0.5], [0.2, 0.9], [0.3, 0.3, 0.6, 0.0]]  # sizes 3, 2, 4 (offline traces)
    flat = [r for g in groups for r in g]
    s = _scored(ro, flat, [3, 2, 4])
    want_group = [(r - sum(g) / len(g)) / (_std(g) + 1e-4) for g in groups for r in g]
    torch.testing.assert_close(advantages(s, "group"), torch.tensor(want_group), rtol=1e-5, atol=1e-6)
    want_none = [r - sum(g) / len(g) for g in groups for r in g]
    torch.testing.assert_close(advantages(s, "none"), torch.tensor(want_none), rtol=1e-5, atol=1e-6)
    batch_std = _std(flat)
    want_batch = [a / (batch_std + 1e-4) for a in want_none]
    torch.testing.assert_close(advantages(s, "batch"), torch.tensor(want_batch), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sizes", [[3, 3, 3, 3], [3, 5, 4]])
def test_row_without_reward_gets_zero_advantage(tokenizer, sizes):
    ro = synthetic_rollout(tokenizer)
    rewards = [0.0, 1.0, float("nan"), 0.5, 0.25, 1.0, 0.0, 0.75, 0.5, 0.1, 0.9, 0.3]
    adv = advantages(_scored(ro, rewards, sizes), "group")
    assert adv[2] == 0.0 and torch.isfinite(adv).all()
    # the NaN row is left out of its group's baseline: the two others are +-1/sqrt(2)/std-normalised
    g0 = [0.0, 1.0]
    want = [(r - 0.5) / (_std(g0) + 1e-4) for r in g0]
    torch.testing.assert_close(adv[:2], torch.tensor(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rollout", ["online", "offline"])
@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus_baseline"])
def test_the_task_uses_grpo_advantage_estimator(make_config, model, tokenizer, traces_file, rollout, estimator):
    """Online and offline GRPO: the generation batch's advantages are the estimator's, over its rewards."""
    from preftune.algorithms.grpo import GRPOTask

    extra = [f"data.train={traces_file}", "grpo.rollout=offline"] if rollout == "offline" else ["grpo.reward_funcs=[length]"]
    cfg = make_config(f"grpo.advantage_estimator={estimator}", *extra)
    task = GRPOTask(cfg, model, tokenizer, torch.device("cpu"), dp=Parallel())
    seen = []
    make = task.source.make_batch
    task.source.make_batch = lambda m, step: seen.append(make(m, step)) or seen[-1]
    task.step(model, 1, _Stop())
    s = seen[0]
    want = group_advantages(s.total, s.group_sizes, estimator=estimator)
    assert (want != 0).any() and not torch.equal(want, group_advantages(s.total, s.group_sizes))
    torch.testing.assert_close(task.pending.advantages, want, rtol=0, atol=0)


# ---------------------------------------------------------------- dynamic sampling (online source)


class _Stop:
    def check(self):
        pass


def controlled_reward(prompts, completions, flat, **_):
    """Flat groups (every completion 0.5) where the `flat` column says so; else 1 for the first
    completion of the group and 0 for the others, so the group has spread whatever was sampled."""
    out, seen = [], set()
    for p, f in zip(prompts, flat):
        out.append(0.5 if f else (0.0 if p in seen else 1.0))
        seen.add(p)
    return out


def _online(tokenizer, flat: list[bool], **cfg_kw) -> OnlineSource:
    prompts = [f"{i}+{i}=" for i in range(len(flat))]
    cfg = GRPOConfig(num_generations=2, max_completion_length=2, dynamic_sampling=True, **cfg_kw)
    return OnlineSource(cfg, tokenizer, PromptSet(prompts, {"flat": flat}), [controlled_reward], seed=0,
                        shuffle=False, truncation=PromptTruncation(16), device=torch.device("cpu"), dp=Parallel())


def test_dynamic_sampling_drops_flat_groups_and_fills(model, tokenizer):
    flat = [True, True, False, True, False, False, True, False, False, True]
    src = _online(tokenizer, flat, prompts_per_step=4, max_resample_rounds=4)
    s = src.make_batch(model, step=1)
    # rounds: [0..3] keeps 1, [4..6] keeps 2, [7] keeps 1 -> full after 3 rounds
    assert s.group_sizes == [2, 2, 2, 2] and s.total.numel() == 8
    assert s.extra["dynamic_sampling/dropped_groups"] == 4
    assert s.extra["dynamic_sampling/rounds"] == 3
    texts = [tokenizer.decode(r[m.bool()]) for r, m in zip(s.rollout.prompt_ids, s.rollout.prompt_mask)]
    assert texts[::2] == ["2+2=", "4+4=", "5+5=", "7+7="]
    assert (advantages(s, "group").view(4, 2) != 0).all()  # every kept group carries signal


def test_dynamic_sampling_respects_max_rounds(model, tokenizer):
    flat = [True, False, True, True] * 4
    src = _online(tokenizer, flat, prompts_per_step=4, max_resample_rounds=1)
    s = src.make_batch(model, step=1)
    # round 1 keeps 1 of 4, one resample keeps 1 of 3: the batch stays short, never padded with flat groups
    assert s.group_sizes == [2, 2] and s.extra["dynamic_sampling/rounds"] == 2
    all_flat = _online(tokenizer, [True] * 6, prompts_per_step=2, max_resample_rounds=2)
    s = all_flat.make_batch(model, step=1)
    assert s.group_sizes == [2, 2] and torch.equal(s.total, torch.full((4,), 0.5))  # last round, zero advantage
    assert s.extra["dynamic_sampling/dropped_groups"] == 6


def test_without_dynamic_sampling_flat_groups_stay(model, tokenizer):
    src = _online(tokenizer, [True, False, True, False], prompts_per_step=4)
    src.cfg.dynamic_sampling = False
    s = src.make_batch(model, step=1)
    assert s.group_sizes == [2] * 4 and "dynamic_sampling/rounds" not in s.extra


# ---------------------------------------------------------------- the task: batch reuse


def test_task_reuses_generation_batch_for_num_iterations(make_config, model, tokenizer):
    from preftune.algorithms.grpo import GRPOTask

    cfg = make_config("grpo.num_iterations=2", "grpo.beta=0.05")
    task = GRPOTask(cfg, model, tokenizer, torch.device("cpu"), dp=Parallel())
    calls = []
    make = task.source.make_batch
    task.source.make_batch = lambda m, step: calls.append(step) or make(m, step)
    batches = []
    for step in (1, 2, 3):
        m = task.step(model, step, _Stop())
        batches.append(task.pending)
        model.zero_grad(set_to_none=True)
        assert math.isfinite(m["loss"]) and m["kl"] >= 0
    assert calls == [1, 3] and batches[0] is batches[1] and batches[2] is not batches[1]
    assert batches[0].rollout.old_logps is not None and batches[0].ref_logps is not None
    state = task.state_dict()
    assert state["pending"] is not None  # a pending reused batch is part of the checkpoint


def test_gradient_checkpointing_gives_the_same_gradients(model, tokenizer):
    import warnings

    from preftune.config import ModelConfig
    from preftune.model.load import load_model
    from tests.conftest import MODEL_DIR

    cfg = GRPOConfig(loss_type="dapo", beta=0.04, micro_batch_size=5, max_completion_length=T)
    batch = _batch(model, tokenizer, cfg)
    plain, _ = run_step(model, batch, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecated transformers API on our side
        ckpt = load_model(ModelConfig(gradient_checkpointing=True), str(MODEL_DIR))
    assert ckpt.checkpointing
    checkpointed, _ = run_step(ckpt, batch, cfg)
    torch.testing.assert_close(checkpointed, plain, rtol=0, atol=1e-5 * plain.abs().max().item())


# ---------------------------------------------------------------- old log-probs recorded by the first step


def _model64():
    from transformers import AutoConfig

    from preftune.model.llama import Llama
    from tests.conftest import MODEL_DIR

    return Llama.from_pretrained(MODEL_DIR, AutoConfig.from_pretrained(str(MODEL_DIR)), dtype=torch.float64)


def _logps_now(model, ro: Rollout, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        lp, _ = completion_logps(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask,
                                 temperature=temperature)
    return lp


def _fresh(ro: Rollout, old=None) -> Rollout:
    return dataclasses.replace(ro, old_logps=old)


def test_reused_batch_old_logps_come_from_its_first_step(tokenizer):
    """num_iterations = 2 (float64): the first step trains on-policy and leaves, in the rollout, the
    log-probs of the weights it ran with; the optimiser step moves the weights; the second step's
    loss and gradient are those of a batch given those old log-probs explicitly (ratio != 1)."""
    model = _model64()
    ro = synthetic_rollout(tokenizer)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    cfg = GRPOConfig(num_iterations=2, beta=0.0, micro_batch_size=5, max_completion_length=T, temperature=0.8)
    batch = GRPOBatch(rollout=ro, advantages=adv, ref_logps=None)
    before = _logps_now(model, ro, cfg.temperature)  # the weights that "sampled" the batch

    model.zero_grad(set_to_none=True)
    m1 = grpo_step(model, batch, cfg, dp=Parallel())
    g1 = flat_grads(model).clone()
    m = ro.completion_mask.bool()
    assert ro.old_logps is not None and ro.old_logps.shape == ro.completion_ids.shape
    assert ro.old_logps.dtype == torch.float64 and not ro.old_logps.requires_grad
    torch.testing.assert_close(ro.old_logps[m], before[m], rtol=0, atol=1e-6)
    assert m1["clip_ratio/region_mean"] == 0.0 and m1["rows_skipped"] == 0.0
    # the first step is the on-policy step of a batch used once
    g_once, _ = run_step(model, GRPOBatch(_fresh(ro), adv, None), dataclasses.replace(cfg, num_iterations=1))
    torch.testing.assert_close(g1, g_once, rtol=0, atol=1e-10 * g_once.abs().max().item())

    recorded = ro.old_logps.clone()
    with torch.no_grad():  # the optimiser step (plain SGD on the first step's gradient)
        offset = 0
        for p in model.parameters():
            p.sub_(300.0 * g1[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    after = _logps_now(model, ro, cfg.temperature)
    assert (after[m] - before[m]).abs().max() > 1e-2  # the policy moved

    g2, m2 = run_step(model, batch, cfg)
    assert torch.equal(ro.old_logps, recorded)  # read, not recorded again
    want, m_want = run_step(model, GRPOBatch(_fresh(ro, before.clone()), adv, None), cfg)
    torch.testing.assert_close(g2, want, rtol=0, atol=1e-6 * want.abs().max().item())
    assert m2["loss"] == pytest.approx(m_want["loss"], rel=1e-6)
    assert m2["clip_ratio/region_mean"] > 0  # ratios left [1 - eps, 1 + eps]: the old log-probs are used
    on_policy, m_on = run_step(model, GRPOBatch(_fresh(ro), adv, None), dataclasses.replace(cfg, num_iterations=1))
    assert m_on["clip_ratio/region_mean"] == 0.0 and m2["loss"] != pytest.approx(m_on["loss"], rel=1e-3)
    assert not torch.allclose(g2, on_policy, rtol=0, atol=1e-3 * on_policy.abs().max().item())


def test_skipped_rows_stay_zero_in_recorded_old_logps(tokenizer):
    """beta = 0: rows with advantage 0 and (masked) truncated rows are skipped by the first step, stay 0
    in the recorded old log-probs, and are skipped again by the later steps of the batch."""
    model = _model64()
    ro = synthetic_rollout(tokenizer)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    adv[[1, 2, 7]] = 0.0
    cfg = GRPOConfig(num_iterations=3, beta=0.0, micro_batch_size=4, max_completion_length=T,
                     mask_truncated_completions=True)
    skipped = (adv == 0) | ro.truncated  # truncated rows: no counted tokens
    assert skipped.sum() > 3 and not skipped.all()
    batch = GRPOBatch(rollout=ro, advantages=adv, ref_logps=None)
    before = _logps_now(model, ro, cfg.temperature)

    _, m1 = run_step(model, batch, cfg)
    assert m1["rows_skipped"] == float(skipped.sum())
    assert (ro.old_logps[skipped] == 0).all()
    live = ~skipped[:, None] & ro.completion_mask.bool()
    torch.testing.assert_close(ro.old_logps[live], before[live], rtol=0, atol=1e-6)
    recorded = ro.old_logps.clone()
    for _ in range(2):  # the later steps: same rows skipped, nothing recorded again
        _, m = run_step(model, batch, cfg)
        assert m["rows_skipped"] == m1["rows_skipped"] and torch.equal(ro.old_logps, recorded)


def test_abandoned_first_step_records_nothing(tokenizer):
    """A step abandoned between micro-batches (preemption) leaves the batch as it was: the step that
    runs whole records the old log-probs."""
    model = _model64()
    ro = synthetic_rollout(tokenizer)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    cfg = GRPOConfig(num_iterations=2, beta=0.0, micro_batch_size=5, max_completion_length=T)
    batch = GRPOBatch(rollout=ro, advantages=adv, ref_logps=None)
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # stands for the preemption notice
    with pytest.raises(KeyboardInterrupt):
        grpo_step(model, batch, cfg, check=check, dp=Parallel())
    model.zero_grad(set_to_none=True)
    assert ro.old_logps is None
    run_step(model, batch, cfg)
    m = ro.completion_mask.bool()
    torch.testing.assert_close(ro.old_logps[m], _logps_now(model, ro, 1.0)[m], rtol=0, atol=1e-6)


@pytest.mark.parametrize("layout", ["shared", "plain"])
@pytest.mark.parametrize("loss_type,beta", [("dapo", 0.0), ("dapo", 0.04), ("bnpo", 0.04)])
def test_the_step_reads_metrics_once_not_per_micro_batch(shared, monkeypatch, loss_type, beta, layout):
    """Nothing waits on the device between micro-batches: as many host reads with N / 2 micro-batches
    as with one, in either log-prob layout (the rows' lengths and prompt runs that size every pass
    are read once, `logps.Rows`; metrics stay on the device until the step ends; bnpo's weights come
    from token counts read once, before the first pass)."""
    import preftune.model.logps as logps

    model, batch = shared
    monkeypatch.setattr(logps, "MASKED", 0.0 if layout == "shared" else 1e9)
    cfg = GRPOConfig(loss_type=loss_type, beta=beta, micro_batch_size=N, max_completion_length=T)
    reads = HostReads(monkeypatch)
    counts = []
    for mb in (N, 2):
        reads.count = 0
        m = grpo_step(model, batch, dataclasses.replace(cfg, micro_batch_size=mb), dp=Parallel())
        model.zero_grad(set_to_none=True)
        counts.append(reads.count)
        assert m["loss"] != 0 and m["entropy"] > 0
    assert N // 2 >= 6 and counts[0] == counts[1] <= 4, counts


def test_a_rank_without_rows_steps_idle(model):
    """A rank whose round drew no prompts (`online.empty_scored`) runs the step on zero rows: no pass,
    zero entropy, nothing skipped."""
    from preftune.rollout.online import empty_scored

    ro = empty_scored(1).rollout
    m = grpo_step(model, GRPOBatch(rollout=ro, advantages=torch.zeros(0), ref_logps=None),
                  GRPOConfig(beta=0.0, micro_batch_size=2), dp=Parallel())
    assert m == {"entropy": 0.0, "rows_skipped": 0.0}
