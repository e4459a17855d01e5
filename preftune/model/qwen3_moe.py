"""Qwen3-MoE (`Qwen3MoeForCausalLM`) in preftune's own module: the Qwen3 block (`core.Block`,
q/k norms) whose MLP is, on the sparse layers, a mixture of experts: a softmax router over all
experts in float32, the top k kept (renormalised to sum 1 when `norm_topk_prob`), each expert a
SwiGLU. Dense layers (`mlp_only_layers`, or off the `decoder_sparse_step` grid) keep `core.MLP`.

The experts run grouped: the (token, expert) assignments are sorted by expert and each expert
multiplies its tokens in one matmul (a loop over experts, never over tokens). Parameters carry
transformers 5's names and layout (`mlp.gate.weight`, `mlp.experts.gate_up_proj` (E, 2I, H) with
gate first, `mlp.experts.down_proj` (E, H, I)); a checkpoint with one module per expert
(`mlp.experts.{e}.gate_proj.weight`, ...) is stacked on load, and saves are in the 3-D layout.
LoRA's "all-linear" adapts the attention projections; the MLPs, the router and the experts (3-D
parameters) train only in a full fine-tune (PEFT's "all-linear" on the HF module also wraps the
experts)."""
from __future__ import annotations

import contextlib
import re

import torch
import torch.nn.functional as F
from torch import nn

from preftune.model import hf_files
from preftune.model import hf_config
from preftune.model.core import MLP, Attention, Block, CausalLM
from preftune.model.ops import cast, merged

# the router's softmax, as transformers computes it (even for a float64 model)
ROUTER_DTYPE = torch.float32


def route(logits: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (N, E) -> the top-k experts' weights (N, k) in the logits' dtype and their
    ids (N, k): softmax over all experts in float32, the k largest, divided by their sum when
    `renormalise` (`norm_topk_prob`)."""
    probs = logits.softmax(-1, dtype=ROUTER_DTYPE)  # (N, E)
    weights, experts = probs.topk(k, dim=-1)  # (N, k)
    if renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), experts


def replayed(logits: torch.Tensor, routes: torch.Tensor,
             renormalise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing replay (R3, arXiv 2510.11370): router logits (N, E) and recorded experts (N, k)
    (-1 where none was recorded: that token keeps the router's own top k) -> weights (N, k), the
    experts run (N, k) and which tokens' recorded set differs from the router's own (N,). The
    weights are the current router's probabilities of the recorded experts, as `route` forms
    them, so the router still gets gradients and equal choices give `route`'s exact values."""
    probs = logits.softmax(-1, dtype=ROUTER_DTYPE)  # (N, E)
    own = probs.topk(routes.size(-1), dim=-1).indices  # (N, k)
    experts = torch.where(routes[:, :1] >= 0, routes.long(), own)  # (N, k)
    weights = probs.gather(-1, experts)  # (N, k)
    if renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), experts, differing(own, routes)


def differing(own: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
    """(N,) True where a token's recorded experts (N, k) are not the set the router chose (N, k);
    False where none was recorded (-1)."""
    same = (own.sort(-1).values == routes.long().sort(-1).values).all(-1)  # (N,)
    return (routes[:, 0] >= 0) & ~same


def grouped_experts(x: torch.Tensor, experts: torch.Tensor,
                    weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """sum over a token's k experts e of weight x down_e (silu(gate_e x) * up_e x) -> (N, H).
    x (N, H); experts, weights (N, k); gate_up (E, 2I, H); down (E, H, I). Assignments are sorted
    by expert (one host read of the counts), each expert's tokens go through one matmul pair."""
    N, k = experts.shape
    flat = experts.reshape(-1)  # (N k,)
    order = flat.argsort(stable=True)  # (N k,) assignments grouped by expert, tokens ascending
    token = order // k
    counts = torch.bincount(flat, minlength=gate_up.size(0)).tolist()  # (E,) on the host
    parts = []
    for e, xs in enumerate(x[token].split(counts)):  # (n_e, H) each
        if xs.size(0):
            gate, up = F.linear(xs, gate_up[e]).chunk(2, dim=-1)  # (n_e, I) each
            parts.append(F.linear(F.silu(gate) * up, down[e]))  # (n_e, H)
    out = x.new_zeros(x.shape)
    if parts:
        y = torch.cat(parts) * weights.reshape(-1)[order, None]  # (N k, H)
        out.index_add_(0, token, y.to(out.dtype))
    return out


class Experts(nn.Module):
    """Every expert's SwiGLU weights as 3-D parameters (transformers 5's names)."""

    def __init__(self, config):
        super().__init__()
        E, H, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, inter))
        if not self.down_proj.is_meta:  # as transformers inits them; meta: filled from weights
            for p in (self.gate_up_proj, self.down_proj):
                nn.init.normal_(p, std=getattr(config, "initializer_range", 0.02))


class SparseMoE(nn.Module):
    """The router (`gate`, no bias) and the experts of one sparse layer."""

    routed = True  # its block takes a rollout's routes (`CausalLM.route_slots`)

    def __init__(self, config):
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config)
        self.top_k, self.renormalise = config.num_experts_per_tok, bool(config.norm_topk_prob)
        self.record: list | None = None  # the router logits of the pass being recorded
        self.differs: list | None = None  # beside them, (N,) recorded route != the router's own
        self.captured: list | None = None  # a rollout's chosen experts (`RouteCapture`)
        # given recorded routes: run them (grpo.routing_replay), else only compare with them
        self.replay = False

    def forward(self, x: torch.Tensor, routes: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., H); routes (..., k) the experts the rollout chose for these tokens, or None."""
        h = x.reshape(-1, x.size(-1))  # (N, H)
        logits = self.gate(h)  # (N, E)
        # passes with gradients only (not a reference or evaluation pass), and not a checkpointed
        # block's recompute in backward (the pass has ended by then)
        recording = self.record is not None and torch.is_grad_enabled()
        if recording:
            self.record.append(logits)
        if routes is not None and self.replay:
            weights, experts, differs = replayed(logits, routes.reshape(-1, self.top_k),
                                                 self.renormalise)  # (N, k), (N, k), (N,)
        else:
            weights, experts = route(logits, self.top_k, self.renormalise)  # (N, k)
            # the rollout's routes only measure the mismatch
            differs = None if routes is None else differing(experts,
                                                            routes.reshape(-1, self.top_k))
        if recording and differs is not None:
            self.differs.append(differs)
        if self.captured is not None:
            self.captured.append(experts)
        return grouped_experts(h, experts, weights, self.experts.gate_up_proj,
                               self.experts.down_proj).view(x.shape)

    def fused(self, dtype: torch.dtype) -> dict:
        return {"router": cast(merged(self.gate)[0], dtype),
                "experts_gate_up": cast(self.experts.gate_up_proj, dtype),
                "experts_down": cast(self.experts.down_proj, dtype)}

    def step(self, residual: torch.Tensor, h: torch.Tensor, w: dict) -> torch.Tensor:
        """residual + this layer's experts on normed h (n, H)."""
        weights, experts = route(F.linear(h, w["router"]), self.top_k, self.renormalise)  # (n, k)
        if self.captured is not None:
            self.captured.append(experts)
        # (n, H)
        out = grouped_experts(h, experts, weights, w["experts_gate_up"], w["experts_down"])
        return residual + out.to(residual.dtype)


class RouterRecord:
    """The router logits of every sparse layer in the training and reference passes run inside
    `pass_`, with each token's weight (what it stands for in the batch: `model/logps.Plan`), for
    the load-balancing loss and the routing metrics (`algorithms/router.py`)."""

    def __init__(self, model: CausalLM):
        self.layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
        self.top_k = self.layers[0].top_k if self.layers else 0
        self.logits: list[torch.Tensor] = []  # (N, E) each: layer by layer, pass after pass
        self.weights: list[torch.Tensor] = []  # (N,) each, beside its logits
        # (N,) each: a token's recorded route differs from its router's (passes given routes)
        self.differs: list[tuple[torch.Tensor, torch.Tensor]] = []  # with the weights

    @contextlib.contextmanager
    def pass_(self, weights: torch.Tensor):
        """One forward pass of (R, W) cells, weights (R W,) flat."""
        seen: list[torch.Tensor] = []
        differs: list[torch.Tensor] = []
        for layer in self.layers:
            layer.record, layer.differs = seen, differs
        try:
            yield
        finally:
            for layer in self.layers:
                layer.record = layer.differs = None
        w = weights.reshape(-1)
        self.logits += seen
        self.weights += [w] * len(seen)
        self.differs += [(d, w) for d in differs]

    def take(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
        """(logits, weights, differs) recorded since the last call."""
        out = self.logits, self.weights, self.differs
        self.logits, self.weights, self.differs = [], [], []
        return out


class RouteCapture:
    """The experts each sparse layer chose in the calls made inside `call` (the own sampler's
    prefill and decode steps), as (N, S, k) per call: S sparse layers, int16, for the rollout's
    `routes`."""

    def __init__(self, model: CausalLM):
        self.layers = [m for m in model.modules() if isinstance(m, SparseMoE)]

    @contextlib.contextmanager
    def call(self, out: list):
        """Appends this call's (N, S, k) routes to `out` once the call returns."""
        seen: list[torch.Tensor] = []
        for layer in self.layers:
            layer.captured = seen
        try:
            yield
        finally:
            for layer in self.layers:
                layer.captured = None
        out.append(torch.stack(seen, 1).to(torch.int16))  # (N, S, k)


def sparse(config, index: int) -> bool:
    """Whether layer `index` is a mixture of experts (else a dense MLP), as transformers decides."""
    return index not in (config.mlp_only_layers or []) and config.num_experts > 0 \
        and (index + 1) % config.decoder_sparse_step == 0


_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class Qwen3Moe(CausalLM):
    """A Qwen3-MoE causal LM with the Hugging Face (transformers 5) parameter names."""

    ARCHITECTURES = ("qwen3_moe",)
    # LoRA's "all-linear": the attention projections. PEFT (0.21, transformers 5) rewrites any
    # gate/up/down_proj target of a qwen3_moe model onto the 3-D experts (its ParamWrapper), which
    # the own module does not adapt, so a dense layer's MLP cannot be named either
    PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")

    @classmethod
    def unsupported(cls, config) -> str | None:
        why = super().unsupported(config)
        if why is None and getattr(config, "use_sliding_window", False):
            return "sliding-window attention"
        return why

    def block(self, config, index: int) -> Block:
        mlp = (SparseMoE(config) if sparse(config, index)
               else MLP(config.hidden_size, config.intermediate_size, False))
        return Block(config, Attention(config, hf_config.layout(config)), mlp)

    @classmethod
    def stored_layout(cls, tensors: dict) -> dict[str, tuple[tuple, list[str]]]:
        """Per-expert checkpoints: each layer's stacked gate_up_proj (E, 2I, H) and down_proj
        (E, H, I), made of its experts' modules, when every expert 0..E-1 is stored."""
        experts: dict[str, dict[int, dict[str, str]]] = {}
        for name in tensors:
            m = _PER_EXPERT.fullmatch(name)
            if m is not None:
                experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = name
        out = {}
        for prefix, per in experts.items():
            if sorted(per) != list(range(len(per))) or any(len(p) != 3 for p in per.values()):
                continue  # incomplete: the whole-state path says which expert is missing
            gate, down = tensors[per[0]["gate_proj"]].shape, tensors[per[0]["down_proj"]].shape
            gate_up = [per[e][k] for e in per for k in ("gate_proj", "up_proj")]
            out[f"{prefix}.gate_up_proj"] = ((len(per), 2 * gate[0], gate[1]), gate_up)
            out[f"{prefix}.down_proj"] = ((len(per), *down), [per[e]["down_proj"] for e in per])
        return out

    @classmethod
    def read_stored(cls, tensors: dict, name: str, start: int, stop: int,
                    dtype: torch.dtype) -> torch.Tensor:
        """Experts start..stop-1 of a stacked experts tensor read from their per-expert modules
        (gate then up, as `hf_state` stacks them); any other tensor as stored."""
        prefix, _, what = name.rpartition(".")
        if name in tensors or what not in ("gate_up_proj", "down_proj"):
            return super().read_stored(tensors, name, start, stop, dtype)

        def whole(e: int, proj: str) -> torch.Tensor:
            key = f"{prefix}.{e}.{proj}.weight"
            return hf_files.read_rows(tensors[key], key, 0, tensors[key].shape[0], dtype)

        if what == "gate_up_proj":  # (2I, H) each
            parts = [torch.cat([whole(e, "gate_proj"), whole(e, "up_proj")])
                     for e in range(start, stop)]
        else:  # (H, I) each
            parts = [whole(e, "down_proj") for e in range(start, stop)]
        return torch.stack(parts)  # (stop-start, ...)

    @classmethod
    def hf_state(cls, state: dict, config) -> dict:
        """Per-expert modules (checkpoints before transformers 5) stacked into the 3-D layout."""
        experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        out = {}
        for name, t in state.items():
            m = _PER_EXPERT.fullmatch(name)
            if m is None:
                out[name] = t
            else:
                experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = t
        for prefix, per in experts.items():
            ids = sorted(per)
            if ids != list(range(config.num_experts)):
                raise KeyError(f"{prefix}: experts {ids[:3]}... of {config.num_experts}")
            # (2I, H) each, gate first
            gate_up = [torch.cat([per[e]["gate_proj"], per[e]["up_proj"]]) for e in ids]
            out[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
            out[f"{prefix}.down_proj"] = torch.stack([per[e]["down_proj"] for e in ids])
        return out
