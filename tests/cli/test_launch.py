"""`preftune launch`: the rendezvous from Volcano / Kubeflow variables or flags, the exit-code
recovery from worker status files, and two launchers on 127.0.0.1 acting as two nodes: a normal run,
SIGTERM to one node (both exit 75, the relaunch ends bitwise equal to the uninterrupted run), and a
data error found by the workers (both exit 78, although torchrun itself reports 1)."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from preftune.cli import launch
from preftune.errors import EXIT_CRASH, EXIT_OK, EXIT_PREEMPTED, EXIT_USER
from tests.distributed.ranks import ROOT, final_state, free_port
from tests.hf_folder import has_weights
from tests.run.test_resume import data_dir, overrides, saved_steps, write_config  # noqa: F401


def flags(**kw) -> argparse.Namespace:
    base = dict(nnodes=None, node_rank=None, master_addr=None, master_port=None, nproc_per_node=None)
    return argparse.Namespace(**(base | kw))


def test_rendezvous_from_volcano_kubeflow_and_flags():
    volcano = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2"}
    r = launch.rendezvous(flags(nproc_per_node=8), volcano)
    assert (r.nnodes, r.node_rank, r.master_addr, r.master_port, r.nproc_per_node) == (3, 2, "job-master-0", 23456, 8)
    pet = {"PET_NNODES": "4", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "1234",
           "PET_NPROC_PER_NODE": "2", **volcano}
    r = launch.rendezvous(flags(), pet)
    assert (r.nnodes, r.node_rank, r.master_addr, r.master_port, r.nproc_per_node) == (4, 1, "m", 1234, 2)
    r = launch.rendezvous(flags(nnodes=2, node_rank=0, master_addr="h", master_port=9), pet)
    assert (r.nnodes, r.node_rank, r.master_addr, r.master_port) == (2, 0, "h", 9)
    r = launch.rendezvous(flags(), {})
    assert (r.nnodes, r.node_rank, r.master_addr, r.nproc_per_node) == (1, 0, "127.0.0.1", 1)
    cmd = launch.torchrun_command(r, "c.yaml", ["a=1"])
    assert "--max-restarts=0" in cmd and cmd[-3:] == ["train", "c.yaml", "a=1"]


@pytest.mark.parametrize("codes, expected", [
    ([0, 0], EXIT_OK), ([75, 75], EXIT_PREEMPTED), ([75, 0], EXIT_PREEMPTED), ([78, 75], EXIT_USER),
    ([1, 75], EXIT_CRASH), ([None, 75], EXIT_CRASH), ([], EXIT_CRASH), ([78, None], EXIT_USER),
])
def test_node_exit_code_from_worker_codes(codes, expected):
    assert launch.combine(codes) == expected


class Node:
    """One `preftune launch` process with Volcano's variables: node `rank` of 2, one worker."""

    def __init__(self, tmp, rank: int, port: int, args: list[str], name: str, **env):
        self.log = tmp / f"{name}-node{rank}.log"
        e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank), **env)
        for k in ("LOCAL_RANK", "PREFTUNE_STATUS_DIR"):
            e.pop(k, None)
        with open(self.log, "w") as f:
            self.p = subprocess.Popen([sys.executable, "-m", "preftune.cli", "launch", *map(str, args),
                                       "--nproc-per-node", "1"], stdout=f, stderr=subprocess.STDOUT, env=e,
                                      cwd=tmp)

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise AssertionError(f"timed out:\n{self.log.read_text()[-3000:]}") from None


def two_nodes(tmp, out, data_dir, name: str, **extra) -> list[Node]:
    port = free_port()
    ovr = overrides("offline", out, data_dir, max_steps=4, save_steps=2, **{"grpo.prompts_per_step": 4}, **extra)
    cfg = write_config(tmp / "run.yaml")
    return [Node(tmp, r, port, [cfg, *ovr], name) for r in (0, 1)]


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nodes")
    nodes = two_nodes(tmp, tmp / "run", data_dir, "reference")
    assert [n.wait() for n in nodes] == [EXIT_OK, EXIT_OK], nodes[0].log.read_text()[-3000:]
    return tmp / "run"


def test_two_nodes_train_to_the_end(reference):
    assert has_weights(reference / "final") and saved_steps(reference) == [4, 2]


def test_sigterm_to_one_node_then_relaunch_equals_uninterrupted(reference, data_dir, tmp_path):
    out = tmp_path / "run"
    nodes = two_nodes(tmp_path, out, data_dir, "first")
    end = time.monotonic() + 300
    while not (out / "metrics.jsonl").is_file() or '"step": 1,' not in (out / "metrics.jsonl").read_text():
        assert time.monotonic() < end and all(n.p.poll() is None for n in nodes), nodes[0].log.read_text()[-3000:]
        time.sleep(0.1)
    nodes[1].p.send_signal(signal.SIGTERM)  # the container runtime signals node 1's launcher (PID 1)
    codes = [n.wait() for n in nodes]  # (3 steps and a save are left: far longer than the forwarding)
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], nodes[1].log.read_text()[-3000:]
    assert "forwarding to workers" in nodes[1].log.read_text()
    again = two_nodes(tmp_path, out, data_dir, "second")
    assert [n.wait() for n in again] == [EXIT_OK, EXIT_OK], again[0].log.read_text()[-3000:]
    wa, wb = final_state(reference), final_state(out)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_data_error_found_by_the_workers_exits_78_on_both_nodes(data_dir, tmp_path):
    nodes = two_nodes(tmp_path, tmp_path / "run", data_dir, "bad", **{"data.train": tmp_path / "missing.parquet"})
    assert [n.wait() for n in nodes] == [EXIT_USER, EXIT_USER]
    assert "torchrun exited 1; workers [78] -> exit 78" in nodes[0].log.read_text()
