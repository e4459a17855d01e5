"""DPO task: micro-batch invariance, the reference log-prob cache, reference-free, weighted loss lists,
and pairs from labeled traces vs a pairs file."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from preftune.algorithms.dpo import DPOTask, sequence_logps
from preftune.data.pairs import build_pairs, write_pairs
from preftune.data.traces import load_traces
from preftune.distributed.group import Parallel
import preftune.algorithms.dpo as dpo_mod
from tests.conftest import flat_grads, write_parquet

CPU = torch.device("cpu")


class _Stop:
    def check(self):
        pass


def make_task(cfg, model, tokenizer) -> DPOTask:
    """A DPO task with its reference log-probs computed (what Run does on a fresh start)."""
    task = DPOTask(cfg, model, tokenizer, CPU, dp=Parallel())
    task.prepare(model)
    return task


def _cfg(make_config, traces_file, *overrides):
    return make_config("algorithm=dpo", f"data.train={traces_file}", "data.pair_strategy=all_pairs",
                       "dpo.batch_size=6", "dpo.micro_batch_size=6", "data.shuffle=false", *overrides)


def _shift(model, scale=0.05, seed=0):
    """Move the policy away from the reference so log-ratios are not all zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def _step(task, model, micro: int):
    """One step from the start of the data order; returns (flat grads, metrics) and leaves grads zeroed."""
    task.stream.load_state_dict({"epoch": 0, "offset": 0})
    task.d.micro_batch_size = micro
    model.zero_grad(set_to_none=True)
    m = task.step(model, 1, _Stop())
    g = flat_grads(model).clone()
    model.zero_grad(set_to_none=True)
    return g, m


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "[sigmoid, hinge, sigmoid_norm]"])
def test_micro_batch_invariance(make_config, traces_file, model, tokenizer, loss):
    cfg = _cfg(make_config, traces_file, f"dpo.loss_type={loss}")
    task = make_task(cfg, model, tokenizer)
    assert len(task.encoded) == 18  # 6 prompts x 1 chosen x 3 rejected (all_pairs)
    _shift(model)
    full, m_full = _step(task, model, 6)
    assert full.abs().max() > 0
    for micro in (1, 4):  # one pair at a time, and uneven (4 + 2)
        part, m_part = _step(task, model, micro)
        torch.testing.assert_close(part, full, rtol=0, atol=1e-5 * full.abs().max().item())
        for k in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen"):
            assert m_part[k] == pytest.approx(m_full[k], rel=1e-5, abs=1e-7), k
        assert m_part["num_tokens"] == m_full["num_tokens"]


def test_trl_token_metrics_and_wpo_weighting(make_config, traces_file, model, tokenizer):
    """TRL's DPO metrics (logits/chosen|rejected, mean_token_accuracy, entropy) are logged, and
    use_weighting (WPO) scales the update without breaking micro-batch invariance."""
    plain = make_task(_cfg(make_config, traces_file), model, tokenizer)
    weighted = make_task(_cfg(make_config, traces_file, "use_weighting=true"), model, tokenizer)  # TRL's name
    assert weighted.d.use_weighting
    _shift(model)
    g_plain, m = _step(plain, model, 6)
    for k in ("logits/chosen", "logits/rejected", "mean_token_accuracy", "entropy"):
        assert k in m and math.isfinite(m[k]), k
    assert 0 <= m["mean_token_accuracy"] <= 1 and m["entropy"] > 0 and m["logits/chosen"] != m["logits/rejected"]
    full, m_full = _step(weighted, model, 6)
    assert not torch.allclose(full, g_plain) and m_full["loss"] != pytest.approx(m["loss"])  # the weights matter
    for micro in (1, 4):
        part, m_part = _step(weighted, model, micro)
        torch.testing.assert_close(part, full, rtol=0, atol=1e-5 * full.abs().max().item())
        for k in ("loss", "logits/chosen", "mean_token_accuracy", "entropy"):
            assert m_part[k] == pytest.approx(m_full[k], rel=1e-5, abs=1e-7), k


def test_reference_logps_cached_and_reused(make_config, traces_file, model, tokenizer, monkeypatch, tmp_path):
    import os
    import shutil

    from tests.conftest import MODEL_DIR

    model_dir = shutil.copytree(MODEL_DIR, tmp_path / "model")  # a private copy whose weights we can "replace"
    cfg = _cfg(make_config, traces_file, f"model.name_or_path={model_dir}")
    task = make_task(cfg, model, tokenizer)
    cache = Path(cfg.output_dir) / "ref_logps.pt"
    saved = torch.load(cache, weights_only=True)
    assert saved["logps"].shape == (18, 2) and torch.equal(saved["logps"], task.ref)
    with torch.no_grad():  # [chosen, rejected] summed log-probs of the initial policy
        lp, _ = sequence_logps(model.eval(), task.encoded[:3], tokenizer.pad_token_id, CPU)
    torch.testing.assert_close(task.ref[:3], torch.stack([lp[:3], lp[3:]], 1), rtol=0, atol=1e-4)
    assert torch.isfinite(task.ref).all()
    # a second task with the same model and pairs reads the cache: no forward pass at all
    calls = []
    real = dpo_mod.sequence_logps
    monkeypatch.setattr(dpo_mod, "sequence_logps", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = make_task(cfg, model, tokenizer)
    assert calls == [] and torch.equal(again.ref, task.ref)
    # new weights in the same folder change the fingerprint: recomputed
    weights_file = model_dir / "model.safetensors"
    st = weights_file.stat()
    os.utime(weights_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    make_task(cfg, model, tokenizer)
    assert len(calls) > 0
    # other pairs (shorter max_length cuts the responses) change the fingerprint: recomputed and re-saved
    calls.clear()
    short = _cfg(make_config, traces_file, f"model.name_or_path={model_dir}", "dpo.max_length=5")
    third = make_task(short, model, tokenizer)
    assert calls and not torch.equal(third.ref, task.ref)
    assert torch.equal(torch.load(cache, weights_only=True)["logps"], third.ref)


class _Rank:
    """Rank `rank` of a world whose other ranks' shares are known (`gather` puts this rank's in its
    place); rank 0's cache read is this rank's own when it is rank 0, else `main`'s answer."""

    def __init__(self, rank: int, world: int, parts: list | None = None, main=None):
        from preftune.distributed.group import Parallel

        self.parallel, self.parts, self.main = Parallel(rank=rank, world=world), parts, main
        self.is_main = rank == 0

    def balanced_share(self, n: int) -> slice:
        return self.parallel.balanced_share(n)

    def on_main(self, fn):
        return fn() if self.is_main else self.main

    def gather(self, obj) -> list:
        return [obj if r == self.parallel.rank else p for r, p in enumerate(self.parts)]


@pytest.mark.parametrize("world", [2, 3, 32])
def test_reference_pass_splits_the_pairs_over_the_ranks(make_config, traces_file, model, tokenizer, monkeypatch,
                                                        world):
    """Each rank computes the reference log-probs of its share of the pairs only (world 32: most
    ranks have none); the gathered shares equal one process's pass, and only rank 0 writes the cache."""
    cfg = _cfg(make_config, traces_file)
    encoded = DPOTask(cfg, model, tokenizer, CPU, dp=Parallel()).encoded
    pad = tokenizer.pad_token_id
    whole = dpo_mod.reference_logps(model, encoded, cfg, pad, CPU, dp=Parallel())  # one process (writes the cache)
    cache = Path(cfg.output_dir) / "ref_logps.pt"
    cache.unlink()
    seen = []
    real = dpo_mod.sequence_logps
    monkeypatch.setattr(dpo_mod, "sequence_logps", lambda m, batch, *a: seen.append(len(batch)) or real(m, batch, *a))
    shares = [_Rank(r, world).balanced_share(len(encoded)) for r in range(world)]
    parts = [whole[s] for s in shares]
    for rank in reversed(range(world)):  # rank 0 last: it writes the cache
        seen.clear()
        got = dpo_mod.reference_logps(model, encoded, cfg, pad, CPU, dp=_Rank(rank, world, parts))
        assert sum(seen) == shares[rank].stop - shares[rank].start
        torch.testing.assert_close(got, whole, rtol=0, atol=1e-5)
        assert cache.exists() == (rank == 0)
    seen.clear()  # a valid cache: rank 0 reads it, every rank gets it, nobody computes
    assert torch.equal(dpo_mod.reference_logps(model, encoded, cfg, pad, CPU, dp=_Rank(1, world, main=whole)), whole)
    assert seen == []


def test_an_unreadable_reference_cache_is_computed_again(make_config, traces_file, model, tokenizer, caplog):
    cfg = _cfg(make_config, traces_file)
    task = make_task(cfg, model, tokenizer)
    cache = Path(cfg.output_dir) / "ref_logps.pt"
    cache.write_bytes(b"not a torch file")
    again = make_task(cfg, model, tokenizer)
    assert torch.equal(again.ref, task.ref) and "unreadable" in caplog.text
    assert torch.equal(torch.load(cache, weights_only=True)["logps"], task.ref)  # rewritten


def test_reference_at_start_gives_log2_and_reference_free_does_not(make_config, traces_file, model, tokenizer):
    cfg = _cfg(make_config, traces_file)
    task = make_task(cfg, model, tokenizer)
    _, m = _step(task, model, 6)
    assert m["loss"] == pytest.approx(math.log(2), abs=1e-5)  # policy == reference: -log sigmoid(0)
    assert m["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    free_cfg = _cfg(make_config, traces_file, "dpo.reference_free=true", f"output_dir={cfg.output_dir}-free")
    free = make_task(free_cfg, model, tokenizer)
    assert free.ref is None
    assert not (Path(free_cfg.output_dir) / "ref_logps.pt").exists()  # no reference pass at all
    _, m_free = _step(free, model, 6)
    assert m_free["loss"] != pytest.approx(math.log(2), abs=1e-3)
    # reference-free rewards are beta * log pi: the mean chosen reward is beta * mean chosen log-prob
    assert m_free["rewards/chosen"] == pytest.approx(free_cfg.dpo.beta * m_free["logps/chosen"], rel=1e-5)


def test_loss_list_is_the_weighted_sum(make_config, traces_file, model, tokenizer):
    cfg = _cfg(make_config, traces_file, "dpo.loss_type=[sigmoid, ipo, sft]", "dpo.loss_weights=[1, 0.5, 0.2]")
    task = make_task(cfg, model, tokenizer)
    _shift(model)
    g_mix, m_mix = _step(task, model, 6)
    parts = []
    for lt in ("sigmoid", "ipo", "sft"):
        task.d.loss_type, task.d.loss_weights = lt, None
        parts.append(_step(task, model, 6))
    want_loss = m_mix["loss"]
    got = 1.0 * parts[0][1]["loss"] + 0.5 * parts[1][1]["loss"] + 0.2 * parts[2][1]["loss"]
    assert want_loss == pytest.approx(got, rel=1e-5)
    want_grad = 1.0 * parts[0][0] + 0.5 * parts[1][0] + 0.2 * parts[2][0]
    torch.testing.assert_close(g_mix, want_grad, rtol=0, atol=1e-5 * want_grad.abs().max().item())


def test_bad_dpo_options_are_user_errors(make_config, traces_file, model, tokenizer):
    from preftune.errors import UserError

    with pytest.raises(UserError, match="dpo.loss_type"):
        make_task(_cfg(make_config, traces_file, "dpo.loss_type=sigmod"), model, tokenizer)
    with pytest.raises(UserError, match="dpo.loss_weights"):
        make_task(_cfg(make_config, traces_file, "dpo.loss_type=[sigmoid, sft]", "dpo.loss_weights=[1]"),
                  model, tokenizer)


def test_pairs_file_equals_pairs_from_traces(make_config, traces_file, model, tokenizer, tmp_path):
    cfg = _cfg(make_config, traces_file, "dpo.reference_free=true")
    from_traces = make_task(cfg, model, tokenizer)
    traces, _ = load_traces(str(traces_file))
    pairs, _ = build_pairs(traces, strategy="all_pairs")
    pairs_file = tmp_path / "pairs.parquet"
    write_pairs(pairs, str(pairs_file))
    from_file = make_task(_cfg(make_config, pairs_file, "dpo.reference_free=true"), model, tokenizer)
    assert [vars(e) for e in from_file.encoded] == [vars(e) for e in from_traces.encoded]
    # and a hand-written TRL-style pairs file (prompt / chosen / rejected only) works too
    own = write_parquet(tmp_path / "own.parquet", [{"prompt": "1+2=", "chosen": "3", "rejected": "4"}])
    task = make_task(_cfg(make_config, own, "dpo.reference_free=true"), model, tokenizer)
    e = task.encoded[0]
    eos = tokenizer.eos_token_id
    assert e.prompt == tokenizer("1+2=").input_ids
    assert e.chosen == tokenizer("3").input_ids + [eos] and e.rejected == tokenizer("4").input_ids + [eos]
    # and TRL's implicit-prompt pairs (chosen / rejected only) train on the same pair
    implicit = write_parquet(tmp_path / "implicit.parquet", [{"chosen": "1+2=3", "rejected": "1+2=4"}])
    assert vars(make_task(_cfg(make_config, implicit, "dpo.reference_free=true"), model, tokenizer).encoded[0]) == vars(e)


def test_pairs_never_exceed_max_length(make_config, tokenizer, tmp_path):
    from preftune.data.pairs import Pair
    from preftune.algorithms.dpo import encode_pairs

    cfg = make_config("algorithm=dpo", "dpo.max_length=6", "data.max_prompt_length=50")
    pairs = [Pair(prompt="12+7=" * 4, chosen="19", rejected="18"), Pair(prompt="1+1=", chosen="2", rejected="22")]
    encoded, stats = encode_pairs(pairs, tokenizer, cfg)
    for e in encoded:
        assert len(e.prompt) + len(e.chosen) <= 6 and len(e.prompt) + len(e.rejected) <= 6
        assert len(e.chosen) >= 1 and len(e.rejected) >= 1
    assert stats["prompts_truncated"] == 1 and stats["completions_truncated"] >= 2


def test_pairs_from_a_folder_whose_first_file_is_empty(make_config, tmp_path):
    from preftune.data.pipeline import load_pairs
    from tests.conftest import arith_traces, write_jsonl

    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "a.jsonl").write_text("")
    write_jsonl(folder / "b.jsonl", arith_traces(3))
    pairs, report = load_pairs(make_config("algorithm=dpo", f"data.train={folder}"))
    assert len(pairs) == 3 and report["pairs"]["pairs_made"] == 3


def test_reference_per_batch_equals_the_precomputed_one(make_config, traces_file, model, tokenizer):
    """dpo.precompute_ref_logps=false: a frozen reference run on each batch gives the same step."""
    cached = make_task(_cfg(make_config, traces_file), model, tokenizer)
    live_cfg = _cfg(make_config, traces_file, "dpo.precompute_ref_logps=false",
                    f"output_dir={cached.cfg.output_dir}-live")
    live = make_task(live_cfg, model, tokenizer)
    assert live.ref is None and live.ref_model is not None and live.ref_model is not model
    assert not (Path(live_cfg.output_dir) / "ref_logps.pt").exists()
    _shift(model)  # the policy moves; both references stay at the initial weights
    g_cached, m_cached = _step(cached, model, 6)
    g_live, m_live = _step(live, model, 3)
    assert m_live["loss"] == pytest.approx(m_cached["loss"], rel=1e-5) and m_live["loss"] != pytest.approx(math.log(2))
    torch.testing.assert_close(g_live, g_cached, rtol=1e-4, atol=1e-6)


def test_reference_per_batch_with_lora_is_the_base_under_the_adapters(make_config, traces_file, tokenizer):
    from preftune.model.load import load_model

    cfg = _cfg(make_config, traces_file, "dpo.precompute_ref_logps=false", "model.lora.enabled=true")
    policy = load_model(cfg.model, cfg.model.name_or_path)
    task = make_task(cfg, policy, tokenizer)
    assert task.ref_model is policy  # no second model in memory
    _, m = _step(task, policy, 6)
    assert m["loss"] == pytest.approx(math.log(2), abs=1e-5)  # fresh adapters are zero: policy == base
    with torch.no_grad():  # move the adapters only: the base (the reference) stays
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(0.05)
    _, m = _step(task, policy, 6)
    assert m["loss"] != pytest.approx(math.log(2), abs=1e-3)


@pytest.mark.parametrize("path", ["packed", "plain"])
def test_the_step_reads_metrics_once_not_per_micro_batch(make_config, traces_file, model, tokenizer, monkeypatch,
                                                         path):
    """Metrics stay on the device until the step ends and the passes are sized on the host (from
    the pairs' token lists, `logps.Rows.of`), packed or plain: as many host reads with 6
    micro-batches as with one."""
    import preftune.model.logps as logps
    from tests.conftest import HostReads

    monkeypatch.setattr(logps, "MASKED", 0.0 if path == "packed" else 1e9)
    task = make_task(_cfg(make_config, traces_file), model, tokenizer)
    reads = HostReads(monkeypatch)
    counts = []
    for micro in (6, 1):
        reads.count = 0
        _, m = _step(task, model, micro)
        counts.append(reads.count)
        assert m["num_tokens"] > 0 and math.isfinite(m["loss"])
    assert counts[0] == counts[1] <= 2, counts


def test_held_out_pairs_are_evaluated_as_trl_does(make_config, traces_file, tmp_path):
    """data.eval as a pairs file (TRL's eval_dataset): eval/loss and eval/rewards/* of the held-out
    pairs before the first step (the policy is the reference: loss ln 2, margins 0) and after."""
    import json

    from preftune.run.loop import Run

    held_out = write_parquet(tmp_path / "held_out.parquet", [
        {"prompt": "1+2=", "chosen": "3", "rejected": "4"}, {"prompt": "5+5=", "chosen": "10", "rejected": "11"},
        {"prompt": "7+1=", "chosen": "8", "rejected": "9"}])
    cfg = _cfg(make_config, traces_file, f"data.eval={held_out}", "max_steps=3", "optim.lr=1e-2")
    Run(cfg, dp=Parallel()).run()
    records = [json.loads(x) for x in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 3] and all(r["eval/num_pairs"] == 3 for r in evals)
    first, last = evals
    assert first["eval/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert first["eval/rewards/margins"] == pytest.approx(0.0, abs=1e-5) and first["eval/rewards/accuracies"] == 0
    assert abs(last["eval/rewards/margins"]) > 1e-3 and last["eval/loss"] != pytest.approx(math.log(2))
    for k in ("eval/rewards/chosen", "eval/logps/rejected", "eval/logits/chosen", "eval/mean_token_accuracy"):
        assert k in last, k


def test_a_pairs_file_is_no_prompt_set_for_preftune_eval(make_config, traces_file, tmp_path):
    """Evaluation from prompts (GRPO, KTO, SFT) answers a pairs file, not misreads it."""
    from preftune.errors import UserError
    from preftune.evaluation.evaluate import eval_prompt_set

    held_out = write_parquet(tmp_path / "held_out.parquet", [{"chosen": "1+2=3", "rejected": "1+2=4"}])
    cfg = _cfg(make_config, traces_file, f"data.eval={held_out}")
    with pytest.raises(UserError, match=r"^data.eval: is a pairs file: held-out pairs are evaluated by DPO"):
        eval_prompt_set(cfg)
