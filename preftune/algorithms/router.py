"""A mixture of experts' routers in training: the load-balancing loss added to every micro-batch's
loss (`model.router_aux_loss_coef`, TRL 1.16's semantics) and the routing metrics. Every algorithm
calls `Routers.added` where it calls `backward`."""
from __future__ import annotations

import logging

import torch

from preftune.errors import UserError
from preftune.losses.moe import load_balancing_loss, router_counts
from preftune.model.core import CausalLM
from preftune.model.load import base_module
from preftune.model.qwen3_moe import RouterRecord

log = logging.getLogger(__name__)

SUMS = "moe/_sums"  # the reduced sums the routing metrics are read from (`finish`)


def _add(a: list[float], b: list[float]) -> list[float]:
    return [x + y for x, y in zip(a, b)]


class Routers:
    """The policy's routers, recorded in its passes with gradients (`RouterRecord`)."""

    EXTREMES = {SUMS: _add}  # `Parallel.reduce_metrics`: the sums add up element by element

    def __init__(self, record: RouterRecord, coef: float):
        self.record, self.coef = record, coef
        self.aux = 0.0
        self.counts = self.entropy = self.total = None
        self.differ = [0.0, 0.0]  # weighted (differing, compared) (layer, token) pairs

    @classmethod
    def of(cls, model, coef: float | None) -> "Routers | None":
        """None for a dense model (an error if `coef` asks for the loss). None (the config's
        value, as TRL reads it) or a number; 0 records the metrics without the loss."""
        base = base_module(model)
        moe = hasattr(base.config, "output_router_logits")  # TRL's test for a mixture of experts
        if coef and not moe:
            raise UserError(f"router_aux_loss_coef is {coef}, but {base.config.model_type} is not "
                            "a mixture of experts", where="model.router_aux_loss_coef")
        record = RouterRecord(base) if isinstance(base, CausalLM) else None
        if not moe or record is None or not record.layers:
            if moe:  # the Hugging Face module's path: its routers are not recorded
                if coef:
                    raise UserError("the routers' loss needs preftune's own module "
                                    f"(model.lean_forward: true; {base.config.model_type})",
                                    where="model.router_aux_loss_coef")
                log.info("mixture of experts on the Hugging Face module: no router loss or "
                         "routing metrics")
            return None
        base.router_record = record
        own = float(getattr(base.config, "router_aux_loss_coef", 0.0) or 0.0)
        return cls(record, own if coef is None else float(coef))

    def added(self, loss: torch.Tensor, share: float) -> torch.Tensor:
        """loss + coef x L x share, L the load-balancing loss of the passes since the last call
        (`losses/moe.load_balancing_loss`), `share` this micro-batch's part of the step's batch."""
        logits, weights, differs = self.record.take()
        for d, w in differs:  # tokens whose rollout routes differ from the router's, by weight
            w = w.double().cpu()  # (N,)
            self.differ = _add(self.differ, [float((w * d.cpu()).sum()), float(w.sum())])
        if not logits:
            return loss
        aux = load_balancing_loss(logits, weights, self.record.top_k)
        self.aux += float(aux.detach()) * share
        counts, entropy, total = router_counts(logits, weights, self.record.top_k,
                                               len(self.record.layers))
        self.counts = counts if self.counts is None else self.counts + counts
        self.entropy = entropy if self.entropy is None else self.entropy + entropy
        self.total = total if self.total is None else self.total + total
        return loss + (self.coef * share) * aux if self.coef else loss

    def metrics(self) -> dict:
        """This rank's partial metrics since the last call: `aux_loss` (TRL's name) weighted by
        share, the sums behind the routing metrics under SUMS (`finish` reads them)."""
        if self.counts is None:
            return {}
        out = {"aux_loss": self.aux,
               SUMS: [float(self.entropy), float(self.total), *self.differ,
                      *self.counts.flatten().tolist()]}
        self.aux, self.counts, self.entropy, self.total = 0.0, None, None, None
        self.differ = [0.0, 0.0]
        return out


    def finish(self, m: dict) -> dict:
        """The reduced sums -> `moe/router_entropy` (mean over tokens and layers, nats),
        `moe/expert_load_min` / `_max`: the least and most loaded expert's share of its layer's
        assignments, over layers (1/E for an even load), and with the rollout's routes
        `moe/routing_mismatch`: the share of (layer, token) pairs whose rollout experts are not the
        set the training pass's router picks (with grpo.routing_replay, the ones replay changed)."""
        sums = m.pop(SUMS, None)
        if sums is None:
            return m
        entropy, total, differ, compared = sums[:4]
        counts = torch.tensor(sums[4:]).view(len(self.record.layers), -1)  # (layers, E)
        share = counts / counts.sum(1, keepdim=True).clamp_min(1e-30)  # (layers, E)
        out = m | {"moe/router_entropy": entropy / max(total, 1e-30),
                   "moe/expert_load_min": float(share.min()),
                   "moe/expert_load_max": float(share.max())}
        if compared:  # the passes were given the rollout's routes
            out["moe/routing_mismatch"] = differ / compared
        return out


def reduce_metrics(dp, m: dict, routers: Routers | None, extremes: dict | None = None) -> dict:
    """`Parallel.reduce_metrics` of a step's metrics with the routers' (`Routers.metrics`) added
    and read (`Routers.finish`) when the model has routers."""
    if routers is None:
        return dp.reduce_metrics(m, extremes)
    both = (extremes or {}) | Routers.EXTREMES
    return routers.finish(dp.reduce_metrics(m | routers.metrics(), both))


def replay_routes(*models) -> None:
    """grpo.routing_replay: the routed layers of the policy (and reference) run the experts the
    sampler recorded (`qwen3_moe.replayed`). An error on a model without them."""
    for model in models:
        if model is None:
            continue
        layers = [m for m in base_module(model).modules() if getattr(m, "routed", False)]
        if not layers:
            raise UserError(f"{base_module(model).config.model_type} on this path has no routed "
                            "layers to replay (a mixture of experts on preftune's own module)",
                            where="grpo.routing_replay")
        for layer in layers:
            layer.replay = True
