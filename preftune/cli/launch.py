"""`preftune launch CONFIG [KEY=VALUE ...]`: the container entrypoint for one node of a multi-node
job.

It reads the rendezvous from the environment (Volcano's pytorch plugin, Kubeflow's PET_* variables)
or from flags, checks the config (exit 78 before anything starts), runs
`torchrun --max-restarts 0 -m preftune.cli train CONFIG ...` (the job's restart policy decides about
restarts, not torchrun), forwards SIGTERM to its workers, and exits with the workers' real code:
torchrun reports 1 for any failed worker, so each worker writes its code to a status folder.

  0 every worker finished · 75 stopped, nothing lost (preempted and saved, ...)
  69 checkpoint storage or a tracker unreachable · 78 config/data error · 1 anything else
  (preftune/errors.py)
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from preftune.errors import (
    EXIT_CRASH,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_UNAVAILABLE,
    EXIT_USER,
    UserError,
)
from preftune.run.preemption import SIGNALS

log = logging.getLogger("preftune")
STATUS_ENV = "PREFTUNE_STATUS_DIR"
DEFAULT_PORT = 29500


@dataclass
class Rendezvous:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    nproc_per_node: int = 1


def _int(env, key: str) -> int | None:
    if key not in env:
        return None
    try:
        return int(env[key])
    except ValueError:
        raise UserError(f"expected an integer, got {env[key]!r}",
                        where=f"environment variable {key}") from None


def rendezvous(args, env=os.environ) -> Rendezvous:
    """Flags win; then Kubeflow's PET_* variables; then Volcano's pytorch plugin (MASTER_ADDR,
    MASTER_PORT, WORLD_SIZE = number of pods, RANK = pod index); then one node on 127.0.0.1."""
    def pick(flag, pet: str, volcano: str | None, default, conv=_int):
        if flag is not None:
            return flag
        for key in (pet, volcano):
            if key and key in env:
                return conv(env, key)
        return default

    text = lambda e, k: e[k]  # noqa: E731
    return Rendezvous(
        nnodes=pick(args.nnodes, "PET_NNODES", "WORLD_SIZE", 1),
        node_rank=pick(args.node_rank, "PET_NODE_RANK", "RANK", 0),
        master_addr=pick(args.master_addr, "PET_MASTER_ADDR", "MASTER_ADDR", "127.0.0.1", text),
        master_port=pick(args.master_port, "PET_MASTER_PORT", "MASTER_PORT", DEFAULT_PORT),
        nproc_per_node=pick(args.nproc_per_node, "PET_NPROC_PER_NODE", None, default_nproc()),
    )


def default_nproc() -> int:
    """The GPUs this node sees, else 1."""
    try:
        import torch

        return torch.cuda.device_count() or 1
    except ImportError:
        return 1


def torchrun_command(rdzv: Rendezvous, config: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={rdzv.nnodes}",
            f"--node-rank={rdzv.node_rank}", f"--nproc-per-node={rdzv.nproc_per_node}",
            f"--master-addr={rdzv.master_addr}",
            f"--master-port={rdzv.master_port}", "--max-restarts=0",
            "-m", "preftune.cli", "train", config, *overrides]


# ---------------------------------------------------------------- worker status files


def worker_status_dir() -> Path | None:
    folder = os.environ.get(STATUS_ENV)
    return Path(folder) if folder and "RANK" in os.environ else None


def write_status(folder: Path, kind: str, value: int) -> None:
    """`kind-RANK` holding `value` (atomic: written beside, then renamed)."""
    path = Path(folder) / f"{kind}-{os.environ['RANK']}"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(value))
    os.replace(tmp, path)


def read_status(folder: Path, kind: str) -> dict[int, int]:
    out = {}
    for p in Path(folder).glob(f"{kind}-*"):
        rank = p.name.split("-", 1)[1]
        if rank.isdigit():
            try:
                out[int(rank)] = int(p.read_text())
            except ValueError:
                pass
    return out


def combine(codes: list[int | None]) -> int:
    """The node's exit code from its workers' (None: a worker that left no code, e.g. SIGKILL)."""
    if not codes:
        return EXIT_CRASH
    if EXIT_USER in codes:
        return EXIT_USER
    if any(c not in (EXIT_OK, EXIT_PREEMPTED, EXIT_UNAVAILABLE) for c in codes):
        return EXIT_CRASH
    for code in (EXIT_UNAVAILABLE, EXIT_PREEMPTED):
        if code in codes:
            return code
    return EXIT_OK


# ---------------------------------------------------------------- the command


def add_parser(sub) -> None:
    p = sub.add_parser(
        "launch", help="container entrypoint: run torchrun for this node of a (multi-node) job"
    )
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", default=[], help="dotted KEY=VALUE overrides")
    p.add_argument("--nnodes", type=int, default=None,
                   help="nodes in the job (default: PET_NNODES, WORLD_SIZE, 1)")
    p.add_argument("--node-rank", type=int, default=None,
                   help="this node's index (default: PET_NODE_RANK, RANK, 0)")
    p.add_argument("--master-addr", default=None,
                   help="rank 0's host (default: PET_MASTER_ADDR, MASTER_ADDR)")
    p.add_argument("--master-port", type=int, default=None,
                   help=f"rank 0's port (default: PET_MASTER_PORT, MASTER_PORT, {DEFAULT_PORT})")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="workers on this node (default: PET_NPROC_PER_NODE, the GPUs seen, else 1)")
    p.set_defaults(handler=run)


def _worker_env(status: Path) -> dict:
    """The workers' environment: torchrun sets RANK/WORLD_SIZE/MASTER_* itself; Volcano's pod-level
    values must not leak into them under other names."""
    env = dict(os.environ)
    env[STATUS_ENV] = str(status)
    return env


def run(args) -> int:
    from preftune.config import load_config

    load_config(args.config, args.overrides)  # a config error stops every node here with 78
    rdzv = rendezvous(args)
    log.info("launch: node %d of %d, %d worker(s), rendezvous %s:%d", rdzv.node_rank, rdzv.nnodes,
             rdzv.nproc_per_node, rdzv.master_addr, rdzv.master_port)
    status = Path(tempfile.mkdtemp(prefix="preftune-status-"))
    try:
        proc = subprocess.Popen(torchrun_command(rdzv, args.config, args.overrides),
                                env=_worker_env(status), start_new_session=True)
        with forward_signals(proc, status):
            rc = proc.wait()
        codes = read_status(status, "exit")
        ranks = range(rdzv.node_rank * rdzv.nproc_per_node,
                      (rdzv.node_rank + 1) * rdzv.nproc_per_node)
        mine = [codes.get(r) for r in ranks]
        code = combine(mine) if rc != 0 or any(c != EXIT_OK for c in mine) else EXIT_OK
        log.info("launch: torchrun exited %d; workers %s -> exit %d", rc, mine, code)
        return code
    finally:
        shutil.rmtree(status, ignore_errors=True)


class forward_signals:
    """SIGTERM, SIGINT, SIGHUP, SIGUSR1 (run/preemption.py's SIGNALS) to the launcher go to the
    workers themselves (their handlers coordinate the stop and the save); torchrun gets a SIGTERM
    only if no worker has registered yet."""

    def __init__(self, proc: subprocess.Popen, status: Path):
        self.proc, self.status, self.old = proc, status, {}

    def _handle(self, signum, frame) -> None:
        pids = read_status(self.status, "pid")
        log.warning("launch: %s, forwarding to %s", signal.Signals(signum).name,
                    f"workers {sorted(pids.values())}" if pids else "torchrun")
        targets = [(pid, signum) for pid in pids.values()] or [(self.proc.pid, signal.SIGTERM)]
        for pid, sig in targets:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def __enter__(self):
        for sig in SIGNALS:
            self.old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)
