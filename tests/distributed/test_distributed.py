"""Data parallel on CPU with gloo: 2 ranks and 1 rank on the same data give the same loss and
gradient norm at every step and the same weights after several steps (offline GRPO, DPO, KTO, SFT, online
GRPO fed identical rollouts; FSDP2 and ddp); a global batch that does not split evenly is refused."""
from __future__ import annotations

import pytest

from preftune.config import load_config
from preftune.distributed.group import Parallel
from preftune.errors import EXIT_OK, EXIT_USER
from preftune.run import loop
from preftune.run.metrics import read_records
from tests.distributed.ranks import WEIGHT_TOL, Ranks, final_state, metric_rows
from tests.run.test_resume import data_dir, one_thread, overrides, small_eval, write_config  # noqa: F401

STEPS = 4
# per kind: an even global batch with uneven work per rank (offline groups of unequal size after
# dropping; online completions of different lengths) and micro-batches, so idle passes are exercised
EXTRA = {
    "offline": {"grpo.prompts_per_step": 4, "grpo.micro_batch_size": 3, "grpo.loss_type": "grpo"},
    # the length reward gives the fake completions (random tokens) a signal; accuracy would be all 0
    "online": {"grpo.prompts_per_step": 4, "grpo.micro_batch_size": 5, "grpo.scale_rewards": "batch",
               "grpo.reward_funcs": "[length]", "grpo.dynamic_sampling": "true", "grpo.num_generations": 2,
               "grpo.loss_type": "bnpo", "grpo.beta": 0.05, "grpo.num_iterations": 2},
    "dpo": {"dpo.batch_size": 4, "dpo.micro_batch_size": 1},
    # z over the whole batch: each rank's mismatched log-ratios summed over the ranks
    # (a heavy desirable weight makes the mismatched log-ratios grow, so z > 0 after a few steps)
    "kto": {"kto.batch_size": 4, "kto.micro_batch_size": 1, "data.rejected_max": 0.3, "kto.desirable_weight": 20},
    # micro-batches of 3 over a share of 4 (3 + 1): uneven micro-batches on each rank
    "sft": {"sft.batch_size": 8, "sft.micro_batch_size": 3},
    "lora": {"dpo.batch_size": 4, "dpo.micro_batch_size": 2, "model.lora.enabled": "true", "model.lora.r": 4,
             "save_steps": 2},
}


# the packer's layout per kind, forced in both runs (`logps.MASKED`): the comparison measures the
# data-parallel split, not two layouts' rounding (which Adam amplifies on near-zero gradients)
LAYOUT = {"offline": "1e9", "online": "0", "dpo": "0", "kto": "1e9", "sft": "1e9", "lora": "1e9"}


def args(kind: str, out, data_dir, **extra) -> list[str]:
    # offline GRPO also evaluates (greedy generation on gathered parameters, every 2 steps)
    ev = {"data.eval": small_eval(data_dir), "eval.eval_steps": 2} if kind == "offline" else {"data.eval": "null"}
    o = {"max_steps": STEPS, "save_steps": 0, "optim.lr": 1e-3, "optim.lr_scheduler": "constant",
         **ev, **EXTRA[kind], **extra}
    return overrides("dpo" if kind == "lora" else kind, out, data_dir, **o)


@pytest.fixture(scope="module")
def one_rank(data_dir, tmp_path_factory):
    """The 1-process runs, in this process (the fake sampler for online GRPO patched in)."""
    done = {}

    def run(kind: str):
        if kind not in done:
            out = tmp_path_factory.mktemp(f"one-{kind}") / "run"
            with pytest.MonkeyPatch.context() as m:
                import preftune.model.logps as logps

                m.setattr(logps, "MASKED", float(LAYOUT[kind]))
                if kind == "online":
                    import preftune.rollout.engine as engine
                    from tests.distributed.ranks import fake_sample

                    m.setattr(engine, "sample", fake_sample)
                loop.train(load_config(None, args(kind, out, data_dir)))
            done[kind] = out
        return done[kind]

    return run


def assert_same_training(one, two) -> None:
    a, b = metric_rows(one), metric_rows(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b):
        for key in ("loss", "grad_norm"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-7), (ra["step"], key)
        for key in ("entropy", "completions/mean_length", "num_tokens"):  # reduced over the ranks where present
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-7), (ra["step"], key)
    evals = [[r["eval/reward"] for r in read_records(out / "metrics.jsonl") if "eval/reward" in r] for out in (one, two)]
    assert evals[0] == evals[1]  # empty, or the same greedy eval rewards at the same steps
    wa, wb = final_state(one), final_state(two)
    assert wa.keys() == wb.keys()
    worst = max(wa, key=lambda k: (wa[k] - wb[k]).abs().max().item())
    assert (wa[worst] - wb[worst]).abs().max().item() < WEIGHT_TOL, f"largest weight difference in {worst}"
    assert all(r["grad_norm"] > 1e-3 for r in a)  # real gradients: Adam would turn rounding noise on a
    # zero gradient (e.g. all advantages 0) into full-size steps in random directions, see docs/ARCHITECTURE.md




# fsdp-offload: FSDP2 with distributed.cpu_offload (online: a reference, the sampler on gathered
# parameters; lora: the path where each rank loads the base and shards it)
@pytest.mark.parametrize("kind, strategy", [("offline", "fsdp"), ("dpo", "fsdp"), ("kto", "fsdp"), ("online", "fsdp"),
                                            ("dpo", "ddp"), ("lora", "fsdp"), ("sft", "fsdp"), ("sft", "ddp"),
                                            ("online", "fsdp-offload"), ("lora", "fsdp-offload")])
def test_two_ranks_train_like_one(kind, strategy, one_rank, data_dir, tmp_path):
    out = tmp_path / "run"
    env = {"PREFTUNE_TEST_FAKE_SAMPLER": "1"} if kind == "online" else {}
    env["PREFTUNE_TEST_MARK_LOADS"], env["PREFTUNE_TEST_MASKED"] = "1", LAYOUT[kind]
    dist = {"distributed.strategy": strategy.removesuffix("-offload"),
            "distributed.cpu_offload": str(strategy.endswith("-offload")).lower()}
    ranks = Ranks(tmp_path, 2, [write_config(tmp_path / "run.yaml"), *args(kind, out, data_dir, **dist)], **env)
    codes = ranks.wait()
    assert codes == [EXIT_OK, EXIT_OK], ranks.text(0)[-3000:] + ranks.text(1)[-3000:]
    assert_same_training(one_rank(kind), out)
    if kind == "offline":
        assert len([r for r in read_records(out / "metrics.jsonl") if "eval/reward" in r]) == 3  # steps 0, 2, 4
    if kind == "lora":  # step checkpoints hold the adapter and its optimizer state only
        from preftune.run import checkpoint_folders as ckpt

        files = ckpt.read_manifest((out / "checkpoints" / "step-2" / ckpt.MANIFEST).read_text())["files"]
        from tests.run.test_resume import MODEL

        model_bytes = (MODEL / "model.safetensors").stat().st_size  # a full checkpoint: 3x (weights, 2 moments)
        assert sum(v["size"] for k, v in files.items() if k.startswith("shards/")) < model_bytes / 2
    if kind == "kto":  # z over the global batch, and partial means that add up over the ranks
        for ra, rb in zip(metric_rows(one_rank(kind)), metric_rows(out)):
            keys = {k for k in ra if k == "kl" or k.startswith(("rewards/", "logps/"))}
            assert keys == {k for k in rb if k == "kl" or k.startswith(("rewards/", "logps/"))} and "kl" in keys
            for key in keys:
                assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-6), (ra["step"], key)
        assert any(r["kl"] > 0 for r in metric_rows(out))
    if kind == "online":  # groups were dropped and resampled, so ranks held unequal rows (idle passes)
        assert any(r["dynamic_sampling/dropped_groups"] for r in metric_rows(out))
    assert " rank 1 INFO rank 1 of 2" in ranks.text(1)  # each rank's log lines carry its rank
    # FSDP2 (full fine-tuning): no rank reads the whole model (the policy, and online GRPO's beta > 0
    # reference, are built on the meta device and each rank reads its own slices; final/ is written
    # by the ranks from gathered tensors, nothing read again)
    models = 2 if kind == "online" else 1
    meta = strategy.startswith("fsdp") and kind != "lora"
    reads = [ranks.text(r).count("TEST weights read") for r in (0, 1)]
    assert reads == [0, 0] if meta else (reads[0] >= models and reads[1] == models)
    assert all(ranks.text(r).count("each rank read its own slices") == (models if meta else 0) for r in (0, 1))
    assert not any("weights sent by rank 0" in ranks.text(r) for r in (0, 1))
    assert not (out / "metrics.jsonl").read_text().count('"step": 1,') > 1  # only rank 0 writes


def test_global_batch_not_divisible_is_refused_by_every_rank(data_dir, tmp_path):
    out = tmp_path / "run"
    ranks = Ranks(tmp_path, 2, [write_config(tmp_path / "run.yaml"), *args("offline", out, data_dir, **{"grpo.prompts_per_step": 3})])
    assert ranks.wait() == [EXIT_USER, EXIT_USER]
    assert "grpo.prompts_per_step=3 not divisible by the world size 2" in ranks.text(0)
    assert not out.exists()


def test_corrupt_weights_read_by_rank_0_stop_every_rank_with_78(data_dir, tmp_path):
    """Under FSDP2 only rank 0 reads the weights; its error reaches rank 1, which has built its
    module from config.json alone, so both exit 78 with the same line instead of rank 1 waiting."""
    import shutil

    from tests.run.test_resume import MODEL

    model = tmp_path / "model"
    shutil.copytree(MODEL, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    out = tmp_path / "run"
    ranks = Ranks(tmp_path, 2, [write_config(tmp_path / "run.yaml"), *args("dpo", out, data_dir, **{
        "distributed.strategy": "fsdp", "model.name_or_path": str(model)})])
    assert ranks.wait() == [EXIT_USER, EXIT_USER]
    for r in (0, 1):
        assert "cannot load model" in ranks.text(r) and "Traceback" not in ranks.text(r)
    assert not out.exists()


def test_a_reward_error_in_one_ranks_eval_share_stops_every_rank_with_78(data_dir, tmp_path):
    """The held-out evaluation is split over the ranks: a reward that fails on a prompt of rank 1's
    share stops rank 0 too (Parallel.together), both with 78 and the reward's one line, at step 0."""
    reward = tmp_path / "picky.py"
    reward.write_text("def picky(prompts, completions, **kw):\n"
                      "    if '3+5=' in prompts:\n"
                      "        raise KeyError('no answer for 3+5=')\n"
                      "    return [0.0] * len(completions)\n")
    out = tmp_path / "run"
    ranks = Ranks(tmp_path, 2, [write_config(tmp_path / "run.yaml"), *args(
        "offline", out, data_dir, **{"distributed.strategy": "fsdp", "eval.reward_funcs": f"[{reward}:picky]"})])
    assert ranks.wait() == [EXIT_USER, EXIT_USER], ranks.text(0)[-2000:] + ranks.text(1)[-2000:]
    for r in (0, 1):
        assert "reward 'picky': raised KeyError" in ranks.text(r) and "Traceback" not in ranks.text(r)


def test_dpo_reference_pass_is_split_and_its_cache_shared_by_rank_0(one_rank, data_dir, tmp_path):
    """2 ranks compute half of the pairs' reference log-probs each; a run that finds rank 0's cache
    (here copied from the 1-process run) computes none, every rank receiving it from rank 0."""
    import shutil

    for cached in (False, True):
        out = tmp_path / f"run-{cached}"
        if cached:
            out.mkdir()
            shutil.copy(one_rank("dpo") / "ref_logps.pt", out / "ref_logps.pt")
        ranks = Ranks(tmp_path, 2, [write_config(tmp_path / "run.yaml"), *args(
            "dpo", out, data_dir, **{"distributed.strategy": "fsdp"})], name=f"ranks-{cached}")
        assert ranks.wait() == [EXIT_OK, EXIT_OK], ranks.text(0)[-2000:] + ranks.text(1)[-2000:]
        for r in (0, 1):
            text = ranks.text(r)
            if cached:
                assert "read from" in text and "computed (" not in text
            else:
                n = int(text.split("reference log-probs of ")[1].split()[0])
                share = Parallel(rank=r, world=2).balanced_share(n)
                assert f"reference log-probs of {n} pairs computed ({share.stop - share.start} on this rank)" in text
        assert_same_training(one_rank("dpo"), out)
