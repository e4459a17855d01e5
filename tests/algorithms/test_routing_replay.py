"""Routing replay (grpo.routing_replay, R3): the own sampler records each token's experts per routed
layer, the training pass runs exactly those (routes recorded = routes used), the routers still get
gradients, the policy ratio against the sampler is 1 where the routers agree and stays near 1 where
they do not, the mismatch metric, the config's errors, and exact resume with pending routes."""
from __future__ import annotations

import pytest
import torch

from preftune.algorithms.router import Routers, reduce_metrics, replay_routes
from preftune.distributed.group import Parallel
from preftune.errors import UserError
from preftune.model import qwen3_moe as M
from preftune.model.logps import completion_logps
from preftune.rollout.sampler import concat, sample, select
from tests.model.test_llama import VOCAB, pair
from tests.hf_folder import folder_state

EOS = 1


def _rollout(model, seed: int = 0):
    """Two prompts of different lengths (left padding), 3 completions each, with the sampler's
    log-probs."""
    g = torch.Generator().manual_seed(seed)
    p_ids = torch.randint(3, VOCAB, (2, 6), generator=g)
    p_mask = torch.ones(2, 6, dtype=torch.long)
    p_mask[1, :2], p_ids[1, :2] = 0, 0
    return sample(model, p_ids, p_mask, num_generations=3, max_new_tokens=7, eos_id=EOS,
                  pad_id=0, generator=g, with_logps=True)


def _logps(model, ro, routes):
    lp, _ = completion_logps(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                             ro.completion_mask, routes=routes)
    return lp  # (N, T)


def test_the_sampler_records_each_fed_tokens_experts():
    """Routes (N, P+T, S, k): every real prompt token and every completion token fed back to the
    model (all but each row's last) has k distinct experts of the router's choice; padding has
    none (-1). In float64 the training pass's routers agree with them everywhere."""
    _, own = pair("qwen3-moe-sparse-step")
    ro = _rollout(own)
    N, P, T = ro.completion_ids.size(0), ro.prompt_ids.size(1), ro.completion_ids.size(1)
    S = sum(s is not None for s in own.route_slots)
    assert 0 < S < len(own.route_slots)  # dense layers have no slot
    assert ro.routes.shape == (N, P + T, S, 2) and ro.routes.dtype == torch.int16
    known = ro.routes[..., 0] >= 0  # (N, P+T, S)
    assert torch.equal(known[:, :P], ro.prompt_mask.bool()[:, :, None].expand(-1, -1, S))
    fed = ro.completion_mask.clone()
    fed[torch.arange(N), ro.completion_mask.sum(1) - 1] = 0  # the last token is never fed
    assert known[:, P:][fed.bool()].all()
    r = ro.routes[known]  # (n, k)
    assert (r[:, 0] != r[:, 1]).all() and (r >= 0).all() and (r < 4).all()
    routers = Routers.of(own, 0.0)
    _logps(own, ro, ro.routes)
    routers.added(torch.zeros(()), 1.0)
    assert reduce_metrics(Parallel(), {}, routers)["moe/routing_mismatch"] == 0.0


def test_replay_runs_the_recorded_experts_and_the_routers_still_learn():
    _, own = pair("qwen3-moe")
    ro = _rollout(own)
    mine = _logps(own, ro, None)
    replay_routes(own)
    # the router's own choices replayed: the same computation, bitwise
    assert torch.equal(_logps(own, ro, ro.routes), mine)
    # other experts (each token's two least likely): what runs is what was given
    other = ro.routes.clone()
    known = other[..., 0] >= 0
    other[known] = (3 - other[known].long()).to(other.dtype)  # E = 4: a different pair
    used: list = []
    capture = M.RouteCapture(own)
    with capture.call(used):
        lp = _logps(own, ro, other)
    assert not torch.allclose(lp, mine)
    loss = -(lp * ro.completion_mask).sum()
    loss.backward()
    gates = [p.grad for n, p in own.named_parameters() if n.endswith("mlp.gate.weight")]
    assert gates and all(g is not None and g.abs().sum() > 0 for g in gates)
    # the training pass's cells carry the routes of the tokens they hold
    ran = {str(x.tolist()) for x in used[0]}  # (R W, S, k): per cell its layers' experts
    given = {str(x.tolist()) for x in other[known.all(-1)]}  # (n, S, k)
    assert given and given <= ran


def test_the_ratio_to_the_sampler_is_one_with_replay_and_not_without():
    """An engine whose routers differ slightly from the trainer's (its own numerics; here a
    small perturbation of its router weights): without replay the tokens whose experts flip give
    ratios far from 1; replaying the engine's experts leaves only the small weight difference."""
    _, engine = pair("qwen3-moe")
    _, trainer = pair("qwen3-moe")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in engine.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05 * p.abs().mean())
    ro = _rollout(engine, seed=3)
    mask = ro.completion_mask.bool()
    routers = Routers.of(trainer, 0.0)
    free = (_logps(trainer, ro, ro.routes) - ro.sampling_logps)[mask].abs().max()
    routers.added(torch.zeros(()), 1.0)
    mismatch = reduce_metrics(Parallel(), {}, routers)["moe/routing_mismatch"]
    replay_routes(trainer)
    replayed = (_logps(trainer, ro, ro.routes) - ro.sampling_logps)[mask].abs().max()
    assert mismatch > 0  # some tokens' experts flipped
    assert replayed < free / 5, (float(replayed), float(free))
    print(f"max |log-ratio|: {float(free):.3g} free, {float(replayed):.3g} replayed; "
          f"mismatch {mismatch:.3f}")
    # and with the engine's own weights, replay gives the sampler's log-probs: ratio 1 (to the
    # float32 the sampler keeps them in)
    replay_routes(engine)
    same = (_logps(engine, ro, ro.routes) - ro.sampling_logps)[mask].abs().max()
    assert same < 1e-6


def test_routes_follow_rows_through_select_and_concat():
    _, own = pair("qwen3-moe")
    a, b = _rollout(own, 0), _rollout(own, 1)
    both = concat([a, select(b, [4, 1])], pad_id=0)
    P, T = both.prompt_ids.size(1), both.completion_ids.size(1)
    pa, ta = a.prompt_ids.size(1), a.completion_ids.size(1)
    assert both.routes.shape[:2] == (8, P + T)
    assert torch.equal(both.routes[:6, P - pa:P], a.routes[:, :pa])
    assert torch.equal(both.routes[:6, P:P + ta], a.routes[:, pa:])
    assert (both.routes[:6, P + ta:] == -1).all()
    pb = b.prompt_ids.size(1)
    assert torch.equal(both.routes[7, P - pb:P], b.routes[1, :pb])


def test_config_errors(tmp_path):
    from preftune.config.load import load_config

    base = {"algorithm": "grpo", "data": {"train": "x.jsonl"}, "output_dir": str(tmp_path / "o"),
            "grpo": {"reward_funcs": ["m:f"], "routing_replay": True}}
    for extra, what in (({"use_vllm": True}, "vLLM"), ({"tools": ["m:t"]}, "tool loop"),
                        ({"rollout": "offline", "reward_funcs": []}, "offline")):
        cfg = base | {"grpo": base["grpo"] | extra}
        with pytest.raises(UserError, match=what) as e:
            load_config(cfg)
        assert e.value.where == "grpo.routing_replay"
    _, dense = pair("qwen3")
    with pytest.raises(UserError, match="no routed layers"):
        replay_routes(dense)


def test_a_run_with_replay_resumes_exactly_with_its_pending_routes(tmp_path):
    """Two optimiser steps per generation batch: a run stopped after step 3 saves the pending
    batch with its routes; resumed to step 4 it ends with the uninterrupted run's weights."""

    import preftune
    from tests.model.test_qwen3_moe import _folder
    from tests.test_api import PROMPTS, brevity, overrides, records

    _, folder = _folder(tmp_path, per_expert=False)
    common = {"model.name_or_path": str(folder), "grpo.routing_replay": True,
              "grpo.num_iterations": 2, "save_steps": 1, "max_steps": 4}
    whole = overrides(tmp_path, "whole", **common)
    preftune.train({}, overrides=whole, reward_funcs=[brevity], train_data=PROMPTS)
    split = overrides(tmp_path, "split", **common)
    preftune.train({}, overrides=split | {"max_steps": 3}, reward_funcs=[brevity],
                   train_data=PROMPTS)
    preftune.train({}, overrides=split, reward_funcs=[brevity], train_data=PROMPTS)
    a, b = (folder_state(tmp_path / n / "final") for n in ("whole", "split"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rec = records(tmp_path / "whole")
    # a step whose rows all have advantage 0 runs no pass, and has no routing metrics
    seen = [r["moe/routing_mismatch"] for r in rec if "moe/router_entropy" in r]
    assert len(rec) == 4 and seen and all(0.0 <= x <= 1.0 for x in seen)


def test_replay_on_a_dense_model_stops_the_run(tmp_path):
    import preftune
    from tests.test_api import PROMPTS, brevity, overrides

    with pytest.raises(UserError, match="no routed layers"):
        preftune.train({}, overrides=overrides(tmp_path, **{"grpo.routing_replay": True}),
                       reward_funcs=[brevity], train_data=PROMPTS)
    assert not (tmp_path / "run" / "final").exists()
