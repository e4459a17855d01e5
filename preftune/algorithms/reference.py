"""Reference log-probs computed once and cached (DPO's pairs, KTO's examples and mismatched pairs).

Computed before the first step with the initial policy (which *is* the reference) and cached in
OUTPUT_DIR/ref_logps.pt, keyed by a fingerprint of the model and the tokenised rows; no reference
model is held during training (TRL's `precompute_ref_log_probs`). Under torchrun each rank computes
a contiguous share of the items, the shares are gathered in rank order and rank 0 writes the cache.
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from preftune.atomic import atomic_path
from preftune.config import Config
from preftune.distributed.group import Parallel
from preftune.model.load import weights_signature
from preftune.model.logps import microbatches

log = logging.getLogger("preftune")
CACHE = "ref_logps.pt"


def fingerprint(cfg: Config, rows: Iterable[tuple]) -> str:
    """The model (path, dtype, weight files) and every item's token lists."""
    model = cfg.model.name_or_path
    h = hashlib.sha256(f"{model}|{cfg.model.dtype}|{weights_signature(model)}".encode())
    for row in rows:
        h.update(repr(row).encode())
    return h.hexdigest()


def read_cache(cache: Path, key: str) -> torch.Tensor | None:
    """The cached log-probs when they were computed for these items and weights. Any failure to
    read them means computing them again (the file is written atomically, so only a foreign one can
    be damaged), and never an exception: the other ranks wait for this answer."""
    try:
        if not cache.exists():
            return None
        saved = torch.load(cache, weights_only=True)
        return (
            saved["logps"] if isinstance(saved, dict) and saved.get("fingerprint") == key else None
        )
    except Exception as e:  # noqa: BLE001 - any damage means: compute them again
        log.warning("%s unreadable (%s): computing the reference log-probs again", cache,
                    type(e).__name__)
        return None


@torch.no_grad()
def cached_reference(model, items: list, logps_of: Callable[[list], torch.Tensor], cfg: Config, *,
                     key_rows: Callable[[], Iterable[tuple]], micro_batch_size: int,
                     what: str, width: int = 2, dp: Parallel) -> torch.Tensor:
    """(n, width) reference log-probs of n items, `logps_of(batch)` -> (b, width) for a micro-batch
    of them, in eval mode. Rank 0 reads the cache and hands it to every rank; without a valid one
    each rank computes its contiguous share (`dp`: distributed/group.py's Parallel) and rank 0
    writes the cache (atomically). `key_rows`: the items' token lists, fingerprinted."""
    cache = Path(cfg.output_dir) / CACHE
    # only rank 0 reads and writes the cache
    key = fingerprint(cfg, key_rows()) if dp.is_main else None
    cached = dp.on_main(lambda: read_cache(cache, key))
    if cached is not None:
        log.info("reference log-probs of %d %s read from %s", len(cached), what, cache)
        return cached
    was_training = model.training
    model.eval()
    mine = items[dp.balanced_share(len(items))]
    out = [torch.zeros(0, width)]  # a rank can hold no items when there are fewer than ranks
    for sl in microbatches(len(mine), micro_batch_size):
        out.append(logps_of(mine[sl]).cpu())
    model.train(was_training)
    logps = torch.cat(dp.gather(torch.cat(out)))  # (n, width)
    log.info("reference log-probs of %d %s computed (%d on this rank)", len(logps), what, len(mine))
    if dp.is_main:
        with atomic_path(cache) as tmp:
            torch.save({"fingerprint": key, "logps": logps}, tmp)
    return logps
