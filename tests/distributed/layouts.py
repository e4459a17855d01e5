"""Run on each of 2 gloo ranks by test_layouts.py: float64 FSDP2 over preftune's module (and the
Hugging Face module), one batch split over the ranks, every layout of the log-prob pass. Each rank
writes its rows' log-probs and the whole (gathered) gradients; rank 0 also the 1-process reference."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from preftune.algorithms.grpo import idle_pass
from preftune.data.tensors import left_pad, right_pad
from preftune.distributed import fsdp
from preftune.distributed.group import Parallel, init
from preftune.config import DistributedConfig
from preftune.model import logps as L
from preftune.model import ops, qwen3_moe
from preftune.model.families import own_class
from tests.model.test_llama import ARCHS, tiny

# (prompt, completion length) per row: two prompts shared by three completions each, and one alone
ROWS = [([5, 6, 7, 8, 9], 4), ([5, 6, 7, 8, 9], 2), ([5, 6, 7, 8, 9], 3),
        ([11, 12, 13], 5), ([11, 12, 13], 1), ([11, 12, 13], 4), ([20, 21, 22, 23, 24, 25, 26], 3)]
LAYOUTS = {"shared": (0.0, True), "causal": (1e9, True), "plain": (1.0, False)}  # (MASKED, pack)


def batch(rows):
    g = torch.Generator().manual_seed(7)
    p_ids, p_mask = left_pad([p for p, _ in rows], 0)  # (B, P)
    comps = [torch.randint(2, 250, (n,), generator=g).tolist() for _, n in ROWS]
    idx = [ROWS.index(r) if r in ROWS else 0 for r in rows]
    c_ids, c_mask = right_pad([comps[i] for i in idx], 0)  # (B, T)
    return p_ids, p_mask, c_ids, c_mask


def weights(c_mask, rows: slice):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(len(ROWS), 6, generator=g, dtype=torch.float64)[rows]  # (B, 6)
    return w[:, : c_mask.size(1)]


def routes(rows: slice, p_mask, c_mask, model):
    """With routing replay: fixed random experts per (row, position, routed layer), laid out as a
    rollout's routes (b, P+T, S, k), -1 at padding; None for a model without routed layers."""
    layers = [m for m in model.modules() if getattr(m, "routed", False)]
    if not REPLAY or not layers:
        return None
    E, k, S = layers[0].experts.gate_up_proj.size(0), layers[0].top_k, len(layers)
    g = torch.Generator().manual_seed(11)
    table = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(len(ROWS) * 16 * S)])
    table = table.view(len(ROWS), 16, S, k)  # (rows, positions, S, k)
    mask = torch.cat([p_mask, c_mask], 1).bool()  # (b, P+T)
    out = torch.full((*mask.shape, S, k), -1, dtype=torch.int16)
    for b, i in enumerate(range(rows.start, rows.stop)):
        # a prompt's tokens get one route whatever row holds them, as the sampler's prefill gives
        first = next(j for j, r in enumerate(ROWS) if r[0] == ROWS[i][0])
        p, n = len(ROWS[i][0]), int(mask[b].sum())
        out[b][mask[b]] = torch.cat([table[first, :p], table[i, p:n]]).to(torch.int16)
    return out


def loss_and_logps(model, rows: slice, masked: float, pack: bool):
    L.MASKED = masked
    part = ROWS[rows]
    if not part:  # a rank with no rows joins the collectives with a zero-weight pass
        idle_pass(model, type("R", (), {"prompt_ids": torch.ones(1, 1, dtype=torch.long)})())
        return torch.zeros(0, 0, dtype=torch.float64)
    p_ids, p_mask, c_ids, c_mask = batch(part)
    logps, ent = L.completion_logps(model, p_ids, p_mask, c_ids, c_mask, with_entropy=True, pack=pack,
                                    temperature=0.7, routes=routes(rows, p_mask, c_mask, model))  # (b, T)
    w = weights(c_mask, rows)
    ((logps * w).sum() + 0.1 * (ent * w).sum()).backward()
    return logps.detach()


REPLAY = False


def replaying(model):
    from preftune.algorithms.router import replay_routes

    replay_routes(model)
    return model


def full_grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name.replace("_fsdp_wrapped_module.", "")] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
    model.zero_grad(set_to_none=True)
    return out


def float64_norms() -> None:
    """RMSNorm in float64 in both modules (HF's runs in float32 even for a float64 model, which would
    cap a comparison of passes that sum gradients in other orders at float32's precision)."""
    from transformers.models.qwen2 import modeling_qwen2

    def f64(x, w, eps):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    modeling_qwen2.Qwen2RMSNorm.forward = lambda self, h: f64(h, self.weight, self.variance_epsilon)
    qwen3_moe.ROUTER_DTYPE = torch.float64
    ops.rms = f64


def main(out: Path, which: str, n_rows: int) -> None:
    float64_norms()
    dp = init(DistributedConfig(strategy="fsdp"))
    global REPLAY
    REPLAY = which.endswith("-replay")  # the experts given, as routing replay runs them
    which = which.removesuffix("-replay")
    model_type, kw = ARCHS["qwen2" if which in ("own", "hf") else which]
    hf = tiny(model_type, **kw)
    make = (lambda: tiny("qwen2")) if which == "hf" else (lambda: own_class(hf.config).of(hf))
    global ROWS
    ROWS = ROWS[:n_rows]
    if REPLAY:
        make = (lambda mk: lambda: replaying(mk()))(make)
    model = fsdp.wrap(Parallel(dp.rank, dp.world, 0, "fsdp", dp.device), make().train())
    share = dp.balanced_share(len(ROWS))
    results = {}
    for name, (masked, pack) in (LAYOUTS.items() if which != "hf" else [("hf", (1.0, True))]):
        logps = loss_and_logps(model, share, masked, pack)
        results[name] = (logps, full_grads(model))
        if dp.rank == 0:
            ref = make().train()
            results[name + "/one"] = (loss_and_logps(ref, slice(0, len(ROWS)), masked, pack), full_grads(ref))
    torch.save({"share": (share.start, share.stop), "results": results}, out / f"rank{dp.rank}.pt")
    dp.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
