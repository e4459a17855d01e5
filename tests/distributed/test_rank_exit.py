"""Every rank of a finished run exits with the run's code (issue 25, item 12).

The abort (`terminate called without an active exception`, SIGABRT on a rank that had printed
`done`) came from the interpreter's teardown: after `destroy_process_group()`, FSDP2's DeviceMesh
(held by the DTensor parameters, the optimizer state and DTensor's sharding caches) keeps the gloo
process groups alive, so their threads (pt_gloo_runloop, gloo_tcp_loop; on rank 0 the TCPStore's
pt_tcpstore_uv) still run when the interpreter finalizes, and they are torn down in whatever order
finalization and the C++ static destructors take, while the other rank may already be gone. The
`preftune` console script ran `main` (a normal interpreter exit) instead of `script`, which ends
the process with `finish` (the exit handlers, the streams flushed, then os._exit: no teardown), as
`python -m preftune.cli` under torchrun always did; the test drivers did the same as the console
script. Here: the live threads at exit are shown once, then two-rank runs finish again and again
with a busy neighbour, through the real entry (`python -m preftune.cli`), and every rank exits 0.
"""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from preftune.errors import EXIT_OK
from tests.distributed.ranks import free_port, rank_env
from tests.run.test_resume import data_dir, one_thread, overrides, write_config  # noqa: F401

RUNS = int(os.environ.get("PREFTUNE_TEST_RANK_EXIT_RUNS", "24"))
AT_ONCE = 3  # two-rank jobs side by side: each is the others' busy neighbour, with the burner below
THREADS_AT_EXIT = """
import atexit, os, sys
def threads():
    names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    print("TEST threads at exit", names, flush=True)
atexit.register(threads)
from preftune.cli.command import script
script(sys.argv[1:])
"""


def two_ranks(tmp, data_dir, name: str, entry: list[str]) -> tuple[list[int], list[str]]:
    out, port = tmp / name, free_port()
    args = [str(write_config(tmp / "run.yaml")), *overrides("offline", out, data_dir, max_steps=1, save_steps=0,
                                                            **{"grpo.prompts_per_step": 4,
                                                               "distributed.timeout_seconds": 60})]
    logs = [tmp / f"{name}-rank{r}.log" for r in range(2)]
    procs = []
    for r in range(2):
        with open(logs[r], "w") as f:
            procs.append(subprocess.Popen([sys.executable, *entry, "train", *args], stdout=f,
                                          stderr=subprocess.STDOUT, cwd=tmp, env=rank_env(r, 2, port)))
    codes = [p.wait(600) for p in procs]
    return codes, [log.read_text() for log in logs]


def test_the_process_groups_outlive_destroy_and_finish_ends_the_ranks_before_teardown(data_dir, tmp_path):
    (tmp_path / "threads.py").write_text(THREADS_AT_EXIT)
    codes, texts = two_ranks(tmp_path, data_dir, "threads", [str(tmp_path / "threads.py")])
    assert codes == [EXIT_OK, EXIT_OK], texts[1][-3000:]
    for text in texts:  # the exit handlers run (finish), the gloo threads are alive then: no teardown follows
        line = next(line for line in text.splitlines() if line.startswith("TEST threads at exit"))
        assert "done." in text, text[-2000:]
        print(line)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a busy neighbour needs /proc and fork")
def test_two_rank_runs_finish_again_and_again_beside_a_busy_neighbour(data_dir, tmp_path):
    overrides("offline", tmp_path, data_dir)  # the traces file, written once before the jobs read it
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # the busy neighbour
    try:
        with ThreadPoolExecutor(AT_ONCE) as pool:
            results = list(pool.map(lambda i: two_ranks(tmp_path, data_dir, f"run{i}", ["-m", "preftune.cli"]),
                                    range(RUNS)))
    finally:
        burner.kill()
    bad = [(i, codes, [t[-600:] for t in texts]) for i, (codes, texts) in enumerate(results)
           if codes != [EXIT_OK, EXIT_OK] or any("terminate called" in t for t in texts)]
    assert not bad, bad[:2]
    assert all("done." in t for _, texts in results for t in texts)
