"""`preftune eval` on held-out pairs: TRL's DPO metrics of a checkpoint (and a baseline) on the
pairs of data.eval, against the reference the run trained from (model.name_or_path), as the held-out
eval during DPO training reports them (`algorithms/dpo.py`, `evaluate_pairs`)."""
from __future__ import annotations

from typing import Callable

import torch

from preftune.algorithms.dpo import EncodedPair, evaluate_pairs, held_out_pairs, sequence_logps
from preftune.data.pipeline import columns
from preftune.distributed.group import Parallel
from preftune.model.logps import microbatches


def is_pairs_file(path: str | None) -> bool:
    """data.eval holds pairs (chosen and rejected columns), not prompts."""
    return bool(path) and {"chosen", "rejected"} <= set(columns(path))


@torch.no_grad()
def reference_pairs(model, pairs: list[EncodedPair], micro_batch_size: int, pad_id: int,
                    device) -> torch.Tensor:
    """(n, 2) summed [chosen, rejected] log-probs of the reference, in eval mode (as training's)."""
    model.eval()
    out = []
    for sl in microbatches(len(pairs), micro_batch_size):
        lp, _ = sequence_logps(model, pairs[sl], pad_id, device)  # (2b,)
        b = len(pairs[sl])
        out.append(torch.stack([lp[:b], lp[b:]], dim=1).cpu())  # (b, 2)
    return torch.cat(out)


def pair_figures(cfg, paths: list[str], load: Callable, device) -> list[tuple[dict, torch.Tensor]]:
    """Per model folder: (figures, 1/0 per pair ranked right). The pairs are encoded with the first
    folder's tokenizer; `load(cfg, path, device) -> (model, tokenizer)`."""
    model, tok = load(cfg, paths[0], device)
    pairs = held_out_pairs(cfg, tok)
    ref = None
    if not cfg.dpo.reference_free:
        ref_model, _ = load(cfg, cfg.model.name_or_path, device)
        ref = reference_pairs(ref_model, pairs, cfg.dpo.micro_batch_size, tok.pad_token_id, device)
        del ref_model
    out = []
    for i, path in enumerate(paths):
        if i:
            model, _ = load(cfg, path, device)
        figures, right = evaluate_pairs(model, pairs, ref, cfg.dpo,
                                        tok.pad_token_id, device, Parallel())
        out.append(({"num_pairs": len(pairs)} | figures, right))
        del model
    return out
