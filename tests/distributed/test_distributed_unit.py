"""distributed/group.py and fsdp.py in one process: torchrun's environment detection, the single-process
identities, the batch split, metric reduction, that FSDP2 generation gathers the parameters
once per rollout, not once per token (a world of one gloo rank, all-gathers counted), and where
distributed.cpu_offload applies."""
from __future__ import annotations

import pytest
import torch

from preftune.distributed import fsdp, group
from preftune.config import DistributedConfig
from preftune.errors import Unavailable, UserError
from tests.distributed.ranks import free_port


def test_torchrun_environment_is_detected():
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert group.torchrun_env(env)
    assert not group.torchrun_env({k: v for k, v in env.items() if k != "LOCAL_RANK"})  # a Volcano pod
    assert not group.init(DistributedConfig(), {}).active


def test_cpu_offload_needs_fsdp_under_torchrun(caplog):
    """One plain process: the key changes nothing, said once; torchrun without FSDP2: an error
    before the process group is joined."""
    with caplog.at_level("WARNING", logger="preftune"):
        assert not group.init(DistributedConfig(cpu_offload=True), {}).offloaded
    assert [r.getMessage() for r in caplog.records if "cpu_offload" in r.getMessage()] == [
        f"distributed.cpu_offload has no effect in one process (not started by torchrun): the "
        f"model stays on {group.Parallel().device}"]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    with pytest.raises(UserError, match="CPU offload is FSDP2's") as e:
        group.init(DistributedConfig(strategy="none", cpu_offload=True), env)
    assert e.value.where == "distributed.cpu_offload"


def test_one_process_collectives_are_identities():
    dp = group.Parallel()
    assert dp.sum(1, 2.5) == [1, 2.5] and dp.max(3) == [3] and dp.gather("x") == ["x"] and dp.broadcast(4) == 4
    assert dp.even_share(6, "k") == slice(0, 6) and dp.balanced_share(5) == slice(0, 5) and dp.row_offset(7) == (0, 7)
    assert dp.reduce_metrics({"a": 1.0}) == {"a": 1.0}
    assert dp.on_main(lambda: 5) == 5


def test_uneven_share_and_divisibility():
    shares = [group.Parallel(rank=r, world=3).balanced_share(7) for r in range(3)]
    assert [(s.start, s.stop) for s in shares] == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(UserError, match="grpo.prompts_per_step=6 not divisible by the world size 4"):
        group.Parallel(rank=0, world=4).require_divisible({"grpo.prompts_per_step": 6})
    group.Parallel(rank=0, world=3).require_divisible({"dpo.batch_size": 6})


@pytest.fixture
def one_rank_group():
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield group.Parallel(0, 1, 0, "fsdp", torch.device("cpu"))
    torch.distributed.destroy_process_group()


def test_metric_reduction_sums_partials_and_keeps_extremes(one_rank_group, monkeypatch):
    dp = one_rank_group
    monkeypatch.setattr(dp, "gather", lambda m: [m, {"loss": 0.5, "ratio_min": -1.0, "ratio_max": 0.0, "only": 3}])
    out = dp.reduce_metrics({"loss": 0.25, "ratio_min": 0.0, "ratio_max": 2.0},
                            {"ratio_min": min, "ratio_max": max})  # the metrics declare theirs
    assert out == {"loss": 0.75, "ratio_min": -1.0, "ratio_max": 2.0, "only": 3}
    # without a declaration a key is a partial sum, whatever its name says
    assert dp.reduce_metrics({"ratio_min": 0.0})["ratio_min"] == -1.0


def test_a_user_error_on_one_rank_stops_every_rank(one_rank_group, monkeypatch):
    """Parallel.together: work split over the ranks (the held-out evaluation) raises another rank's
    UserError here too, so no rank waits at a collective for one that has exited with 78."""
    dp = one_rank_group
    assert dp.together(lambda: 7) == 7
    failed = ("UserError", "eval.jsonl: reward 'exact': raised KeyError: 'answer'")  # rank 1's (kind, line)
    monkeypatch.setattr(dp, "gather", lambda obj: [obj, failed])
    with pytest.raises(UserError, match="reward 'exact': raised KeyError"):
        dp.together(lambda: 7)  # fine here, failed on rank 1
    monkeypatch.setattr(dp, "gather", lambda obj: [obj, ("Unavailable", "cannot write checkpoint step-2")])
    with pytest.raises(Unavailable, match="step-2"):  # the error keeps its kind (and exit code) across ranks
        dp.together(lambda: 7)

    def fails():
        raise UserError("row 3: bad", where="a.jsonl")

    monkeypatch.setattr(dp, "gather", lambda obj: [obj, None])
    with pytest.raises(UserError, match="a.jsonl: row 3: bad"):
        dp.together(fails)


def test_generation_gathers_parameters_once_per_rollout(one_rank_group, model, tokenizer, monkeypatch):
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group

    from preftune.data.tensors import left_pad

    from preftune.rollout.sampler import sample

    calls = []
    real = group.FSDPParamGroup.unshard

    def counted(self, *a, **k):  # an unshard that gathers (with one rank, FSDP2 skips only the copy)
        if self._all_gather_result is None and not self.is_unsharded:
            calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(group.FSDPParamGroup, "unshard", counted)
    wrapped = fsdp.wrap(one_rank_group, model)
    blocks = len(fsdp.fsdp_modules(wrapped))
    assert blocks == model.config.num_hidden_layers + 1  # each decoder block, then the root
    ids, mask = left_pad([tokenizer.encode("1+2="), tokenizer.encode("3+4=")], tokenizer.pad_token_id)

    def rollout():
        return sample(wrapped, ids, mask, num_generations=2, max_new_tokens=6, eos_id=-1,
                      pad_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0))

    calls.clear()
    with fsdp.whole(wrapped):
        a = rollout()
    assert len(calls) == blocks  # one all-gather per sharded module for the whole rollout
    calls.clear()
    b = rollout()
    assert len(calls) == blocks  # without it, the sampler gathers once itself (its step reads whole weights)
    assert torch.equal(a.completion_ids, b.completion_ids)


def test_cpu_offload_policy_reaches_every_sharded_module(one_rank_group, model):
    """The policy (and the frozen reference, through the same `wrap`) is sharded with FSDP2's
    CPUOffloadPolicy (unpinned: no accelerator here), and computes where its inputs are."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from preftune.model.load import device_of

    one_rank_group.cpu_offload = True
    wrapped = fsdp.wrap(one_rank_group, model)
    policies = [m._get_fsdp_state()._fsdp_param_group.offload_policy for m in fsdp.fsdp_modules(wrapped)]
    assert len(policies) == model.config.num_hidden_layers + 1
    assert all(isinstance(p, CPUOffloadPolicy) and not p.pin_memory for p in policies)
    assert device_of(wrapped) == torch.device("cpu")


@pytest.mark.parametrize("after", [False, True])
def test_whole_gives_back_the_configured_reshard_after_forward(one_rank_group, model, after):
    """fsdp.whole keeps the gathered parameters inside the block, then restores each sharded module's
    own reshard_after_forward (it used to set True on every module whatever was configured)."""
    wrapped = fsdp.wrap(one_rank_group, model, reshard_after_forward=after)
    before = [fsdp._reshards(m) for m in fsdp.fsdp_modules(wrapped)]
    assert before == [after] * len(before)
    with fsdp.whole(wrapped):
        assert not any(fsdp._reshards(m) for m in fsdp.fsdp_modules(wrapped))
    assert [fsdp._reshards(m) for m in fsdp.fsdp_modules(wrapped)] == before
