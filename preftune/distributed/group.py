"""The process group: rank, world size, collectives and how a batch is partitioned over the ranks.

`Parallel` is handed to the loop, the checkpointer and the tasks; everything else sees only its
rank, world size and a few reductions. One process (no torchrun) gets a `Parallel` whose
collectives are identities, so the single-process path runs the same code. Applying FSDP2/DDP to
a model is `distributed/fsdp.py`'s.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os

import torch

from preftune.errors import KNOWN, UserError, same_error

log = logging.getLogger("preftune")


def _kind(e: BaseException) -> str:
    """The name of the known error class `e` is (a subclass travels as its known base)."""
    names = ("Preempted", "CheckpointDamaged", *(k.__name__ for k in KNOWN))
    return next(c.__name__ for c in type(e).__mro__ if c.__name__ in names)


def torchrun_env(env=os.environ) -> bool:
    """True when started by torchrun (or any launcher that sets its variables)."""
    return all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


class Parallel:
    """Rank, world size and the collectives the training code needs (identities on one process)."""

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0, strategy: str = "none",
                 device: torch.device | None = None, cpu_offload: bool = False):
        self.rank, self.world, self.local_rank, self.strategy = rank, world, local_rank, strategy
        self.cpu_offload = cpu_offload  # distributed.cpu_offload: FSDP2 shards live in host memory
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.active = torch.distributed.is_available() and torch.distributed.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.active and self.strategy == "fsdp"

    @property
    def offloaded(self) -> bool:
        """FSDP2 with CPUOffloadPolicy: each rank's shards, gradients and Adam state in host
        memory, gathered onto `device` for each forward and backward."""
        return self.sharded and self.cpu_offload

    # ---------------------------------------------------------------- collectives

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()

    def _reduce(self, values: list[float], op) -> list[float]:
        if not self.active or not values:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.comm_device())
        torch.distributed.all_reduce(t, op=op)
        return t.tolist()

    def sum(self, *values: float) -> list[float]:
        return self._reduce(list(values), torch.distributed.ReduceOp.SUM if self.active else None)

    def max(self, *values: float) -> list[float]:
        return self._reduce(list(values), torch.distributed.ReduceOp.MAX if self.active else None)

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any rank (the preemption flag)."""
        return bool(self.max(float(flag))[0])

    def gather(self, obj) -> list:
        """`obj` of every rank, in rank order, on every rank (small Python objects)."""
        if not self.active:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def on_main(self, fn, *, share: bool = True):
        """Run `fn` on rank 0 only and hand its result to every rank (`share` False: to rank 0 only,
        None elsewhere); a known error there (UserError, TryAgain, Unavailable) is raised on every
        rank (so all exit with its code together instead of the others waiting for it)."""
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except KNOWN as e:
                if not self.active:
                    raise
                error = (_kind(e), str(e))
        if share:
            result, error = self.broadcast((result, error))
        else:
            error = self.broadcast(error)
        if error is not None:
            raise same_error(*error)
        return result

    def together(self, fn):
        """Run `fn` on every rank; a known error on any rank is raised on every rank (the lowest
        such rank's), so all exit with its code together instead of the others waiting at their next
        collective for a rank that has left (work split over ranks: each sees only its share)."""
        if not self.active:
            return fn()
        result, error = None, None
        try:
            result = fn()
        except KNOWN as e:
            error = (_kind(e), str(e))
        errors = [e for e in self.gather(error) if e is not None]
        if errors:
            raise same_error(*errors[0])
        return result

    def comm_device(self) -> torch.device:
        return self.device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")

    # ---------------------------------------------------------------- batch split

    def even_share(self, n: int, what: str) -> slice:
        """This rank's equal, contiguous share of n global items (a global batch); n must divide
        evenly (checked at start-up)."""
        if n % self.world:
            raise UserError(f"{what}={n} is not divisible by the {self.world} ranks", where=what)
        k = n // self.world
        return slice(self.rank * k, (self.rank + 1) * k)

    def balanced_share(self, n: int) -> slice:
        """This rank's contiguous part of n items when n need not divide evenly (resampling rounds,
        evaluation prompts, reference caches): the first n % world ranks get one more."""
        return slice(self._share_start(n, self.rank), self._share_start(n, self.rank + 1))

    def engine_group_share(self, n: int, size: int) -> slice:
        """The balanced shares of this rank's group of `size` consecutive ranks, as one slice: what
        a tensor-parallel engine the group runs together samples."""
        first = self.rank - self.rank % size
        return slice(self._share_start(n, first), self._share_start(n, first + size))

    def _share_start(self, n: int, rank: int) -> int:
        """Where rank `rank`'s share of n items starts (rank == world: n)."""
        k, extra = divmod(n, self.world)
        return rank * k + min(rank, extra)

    def row_offset(self, n_local: int) -> tuple[int, int]:
        """(rows on lower ranks, rows on all ranks) for this rank's n_local rows."""
        counts = self.gather(n_local)
        return sum(counts[:self.rank]), sum(counts)

    def require_divisible(self, values: dict[str, int]) -> None:
        """Global batch sizes are split over the ranks: each must divide evenly (exit 78
        otherwise)."""
        bad = [f"{k}={v}" for k, v in values.items() if v % self.world]
        if bad:
            raise UserError(f"{', '.join(bad)} not divisible by the world size {self.world} (the "
                            "global batch "
                            "is split evenly over the ranks)", where=", ".join(k for k in values))

    def reduce_metrics(self, m: dict, extremes: dict | None = None) -> dict:
        """Per-rank partial metrics -> global: the keys of `extremes` combine by its function (min,
        max), the rest are partial sums (each rank pre-weights by its share of the global batch). A
        key missing on a rank (a NaN it skipped) is combined over the ranks that have it."""
        if not self.active:
            return m
        out: dict = {}
        for part in self.gather(m):
            for k, v in part.items():
                combine = (extremes or {}).get(k)
                if k not in out:
                    out[k] = v
                else:
                    out[k] = combine(out[k], v) if combine else out[k] + v
        return out

    def close(self) -> None:
        if self.active:
            with contextlib.suppress(Exception):
                torch.distributed.destroy_process_group()
            self.active = False


def init(cfg, env=os.environ) -> Parallel:
    """Join torchrun's process group when its environment is there; else one process."""
    if not torchrun_env(env):
        if cfg.cpu_offload:  # one process keeps its model whole where it computes
            log.warning("distributed.cpu_offload has no effect in one process (not "
                        "started by torchrun): the model stays on %s", Parallel().device)
        return Parallel()
    rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    if cfg.strategy == "none" and world > 1:
        raise UserError(f"strategy none runs one process, but torchrun started {world}",
                        where="distributed.strategy")
    if cfg.strategy == "none" and cfg.cpu_offload:  # no FSDP2 to offload with
        raise UserError("CPU offload is FSDP2's: set distributed.strategy=fsdp under torchrun",
                        where="distributed.cpu_offload")
    cuda = torch.cuda.is_available()
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if cuda else "gloo")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(backend=backend, rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=cfg.timeout_seconds))
    log.info("rank %d of %d (local %d): strategy %s, backend %s, device %s%s", rank,
             world, local, cfg.strategy, backend, device,
             ", parameters and optimizer state in host memory" if cfg.cpu_offload else "")
    return Parallel(rank, world, local, cfg.strategy, device, cpu_offload=cfg.cpu_offload)

