"""The load-balancing loss of a mixture of experts' routers, and what the metrics read from them."""
from __future__ import annotations

import torch


def load_balancing_loss(router_logits: list[torch.Tensor], weights: list[torch.Tensor],
                        top_k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, arXiv 2101.03961, eqs. 4-6), as
    transformers computes it for Qwen3-MoE (`load_balancing_loss_func`, which TRL 1.16 adds with
    `router_aux_loss_coef`). Over every recorded (layer, token) pair t with weight w_t and router
    probabilities p_t = softmax(logits_t) over the E experts:

        f_e = sum_t w_t 1[e in top-k(p_t)] / sum_t w_t     (assignments per token; sum_e f_e = k)
        P_e = sum_t w_t p_{t,e} / sum_t w_t
        L   = E sum_e f_e P_e

    L is k for a uniform router with even load, larger as load and probability concentrate; the
    gradient flows through P only (top-k is a choice). router_logits[i] (N_i, E): one sparse layer
    of one pass; weights[i] (N_i,): what each token stands for (a shared prompt's token once per
    completion that reads it, padding 0), so a packed pass gives the plain layout's value."""
    E = router_logits[0].size(-1)
    wide = torch.promote_types(router_logits[0].dtype, torch.float32)
    f = torch.zeros(E, dtype=wide, device=router_logits[0].device)  # (E,)
    P = torch.zeros(E, dtype=wide, device=router_logits[0].device)  # (E,)
    total = torch.zeros((), dtype=wide, device=router_logits[0].device)
    for logits, w in zip(router_logits, weights):
        p = logits.softmax(-1, dtype=wide)  # (N, E)
        w = w.to(wide)  # (N,)
        top = p.detach().topk(top_k, dim=-1).indices  # (N, k)
        f = f.scatter_add(0, top.reshape(-1), w.repeat_interleave(top_k))
        P = P + (p * w[:, None]).sum(0)
        total = total + w.sum()
    return E * ((f / total) * (P / total)).sum()


@torch.no_grad()
def router_counts(router_logits: list[torch.Tensor], weights: list[torch.Tensor], top_k: int,
                  layers: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sums for the metrics: per layer the weighted assignments to each expert (layers, E), the
    weighted router entropy sum_t w_t H(p_t) and the weight sum sum_t w_t. The logits come layer by
    layer, pass after pass: entry i is layer i % layers."""
    E = router_logits[0].size(-1)
    counts = torch.zeros(layers, E, dtype=torch.float64)
    entropy = torch.zeros((), dtype=torch.float64)
    total = torch.zeros((), dtype=torch.float64)
    for i, (logits, w) in enumerate(zip(router_logits, weights)):
        p = logits.float().softmax(-1)  # (N, E)
        w = w.double().cpu()  # (N,)
        top = p.topk(top_k, dim=-1).indices.cpu()  # (N, k)
        counts[i % layers].scatter_add_(0, top.reshape(-1), w.repeat_interleave(top_k))
        entropy += (w * -(p * p.clamp_min(1e-30).log()).sum(-1).double().cpu()).sum()
        total += w.sum()
    return counts, entropy, total
