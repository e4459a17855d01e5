"""A mixture of experts' routers in training (`algorithms/router.py`): the load-balancing loss of a
packed pass equals the Hugging Face module's on the plain layout (value and router gradients,
float64), TRL's coefficient rules, the routing metrics, and a run that logs them."""
from __future__ import annotations

import pytest
import torch

from preftune.algorithms.router import Routers, reduce_metrics
from preftune.distributed.group import Parallel
from preftune.errors import UserError
from preftune.model.logps import completion_logps
from tests.model.test_llama import VOCAB, pair

G = 3  # completions per prompt: the packed pass computes each prompt once


def _batch():
    g = torch.Generator().manual_seed(2)
    prompts, completions = [], []
    for P, lengths in ((4, (3, 5, 1)), (6, (2, 4, 4))):
        prompt = torch.randint(3, VOCAB, (P,), generator=g).tolist()
        for c in lengths:
            prompts.append(prompt)
            completions.append(torch.randint(3, VOCAB, (c,), generator=g).tolist())
    P, T = max(map(len, prompts)), max(map(len, completions))
    p_ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    p_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    c_ids = torch.tensor([c + [0] * (T - len(c)) for c in completions])
    c_mask = torch.tensor([[1] * len(c) + [0] * (T - len(c)) for c in completions])
    return p_ids, p_mask, c_ids, c_mask


def _hf_aux(hf, p_ids, p_mask, c_ids, c_mask):
    attn = torch.cat([p_mask, c_mask], 1)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    return hf(input_ids=torch.cat([p_ids, c_ids], 1), attention_mask=attn, position_ids=pos,
              output_router_logits=True).aux_loss


@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen3-moe-sparse-step"])
def test_packed_pass_gives_the_plain_layouts_loss_and_router_gradients(arch):
    hf, own = pair(arch)
    routers = Routers.of(own, 1.0)
    batch = _batch()
    completion_logps(own, *batch)  # packed: each prompt once, its completions as branches
    loss = routers.added(torch.zeros((), dtype=torch.float64), share=1.0)
    want = _hf_aux(hf, *batch)
    torch.testing.assert_close(loss, want.double(), rtol=1e-6, atol=0)  # transformers' sums: fp32
    loss.backward()
    want.backward()
    gates = [n for n, _ in own.named_parameters() if n.endswith("mlp.gate.weight")]
    assert gates
    hf_params, own_params = dict(hf.named_parameters()), dict(own.named_parameters())
    for n in gates:
        torch.testing.assert_close(own_params[n].grad, hf_params[n].grad, rtol=1e-5, atol=1e-7)


def test_passes_without_gradients_are_not_recorded():
    _, own = pair("qwen3-moe")
    routers = Routers.of(own, None)
    with torch.no_grad():  # a reference or evaluation pass
        completion_logps(own, *_batch())
    loss = torch.ones(())
    assert routers.added(loss, 1.0) is loss and routers.metrics() == {}


def test_coefficient_rules_as_trl():
    """None: the model's own (Qwen3-MoE's config says 0.001); 0: metrics without the loss; a dense
    model with a coefficient: one clear error; a dense model otherwise: nothing."""
    hf, own = pair("qwen3-moe")
    assert Routers.of(own, None).coef == hf.config.router_aux_loss_coef == 0.001
    off = Routers.of(own, 0.0)
    completion_logps(own, *_batch())
    loss = torch.ones((), dtype=torch.float64)
    assert off.added(loss, 1.0) is loss and off.metrics()["aux_loss"] > 0
    _, dense = pair("qwen3")
    assert Routers.of(dense, None) is None and Routers.of(dense, 0.0) is None
    with pytest.raises(UserError, match="not a mixture of experts"):
        Routers.of(dense, 0.01)
    with pytest.raises(UserError, match="own module"):
        Routers.of(hf, 0.01)


def test_metrics_expert_load_and_entropy():
    """Counts of the step's assignments, reduced over ranks as sums, read as the least and most
    loaded expert's share and the mean router entropy."""
    _, own = pair("qwen3-moe")
    routers = Routers.of(own, 0.0)
    completion_logps(own, *_batch())
    routers.added(torch.zeros(()), 1.0)
    m = reduce_metrics(Parallel(), {"loss": 1.0}, routers)
    E = 4
    assert 0.0 <= m["moe/expert_load_min"] <= 1 / E <= m["moe/expert_load_max"] <= 0.5  # top 2
    assert 0.0 < m["moe/router_entropy"] < torch.log(torch.tensor(float(E)))
    assert not any(k.startswith("moe/_") for k in m)


def test_a_run_on_a_mixture_of_experts_logs_the_routing_metrics(tmp_path):
    import preftune
    from tests.model.test_qwen3_moe import _folder
    from tests.test_api import PROMPTS, brevity, overrides, records

    _, folder = _folder(tmp_path, per_expert=False)
    out = overrides(tmp_path, **{"model.name_or_path": str(folder),
                                 "model.router_aux_loss_coef": 0.01})
    preftune.train({}, overrides=out, reward_funcs=[brevity], train_data=PROMPTS)
    rec = records(tmp_path / "run")[-1]
    assert rec["aux_loss"] > 0 and 0 < rec["moe/expert_load_min"] <= rec["moe/expert_load_max"]
    assert rec["moe/router_entropy"] > 0


def test_trls_name_is_the_model_key(tmp_path):
    from trl import GRPOConfig

    from preftune.config.trl_config import translate

    data, _ = translate(GRPOConfig(output_dir=str(tmp_path), router_aux_loss_coef=0.01, use_cpu=True,
                                   bf16=False, max_steps=3))
    assert data["model"]["router_aux_loss_coef"] == 0.01
