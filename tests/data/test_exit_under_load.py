"""Exit codes stay exact under CPU load: no "terminate called without an active exception" (134).

The cause was arrow reading from a Python object (io.BytesIO): its reader threads take the GIL, and
one still doing so at interpreter shutdown is ended by CPython with pthread_exit, which unwinds
through noexcept C++ frames and calls std::terminate after the command has already answered. With
a busy neighbour (which delays those threads) it showed in about 1 run in 10; the readers now get
arrow-owned memory (`traces.arrow_input`).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from preftune.data import traces as traces_mod
from preftune.data.traces import TraceOptions, load_traces
from tests.conftest import ROOT, arith_traces, write_parquet

RUNS = 9  # 2-6 s each on a loaded 2-core machine


def test_arrow_never_reads_a_python_object(tmp_path, monkeypatch):
    seen = []

    def spy(real):
        def wrapper(source, *a, **k):
            seen.append(source)
            return real(source, *a, **k)
        return wrapper

    monkeypatch.setattr(pq, "read_table", spy(pq.read_table))
    monkeypatch.setattr(pa_csv, "read_csv", spy(pa_csv.read_csv))
    monkeypatch.setattr(pa_csv, "open_csv", spy(pa_csv.open_csv))
    write_parquet(tmp_path / "a.parquet", arith_traces(2))
    (tmp_path / "b.csv").write_text("input,output,final_reward\nq,r,0.5\n")
    load_traces(str(tmp_path), TraceOptions())
    assert len(seen) >= 2
    for source in seen:  # a native stream over arrow-owned memory, not a Python file or bytes
        assert isinstance(source, pa.BufferReader), type(source)
    assert traces_mod.arrow_input(b"xyz").read() == b"xyz"


def test_exit_codes_are_exact_beside_a_busy_neighbour(tmp_path):
    good = write_parquet(tmp_path / "good.parquet", arith_traces())
    no_reward = write_parquet(tmp_path / "noreward.parquet",
                              [{"input": r["input"], "output": r["output"]} for r in arith_traces()])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cases = [(["data", "inspect", str(good)], 0),
             (["data", "pairs", str(no_reward), "-o", str(tmp_path / "p.parquet")], 78),
             (["data", "pairs", str(good), "-o", str(tmp_path / "q.parquet")], 0)]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        codes = []
        for i in range(RUNS):
            argv, want = cases[i % len(cases)]
            p = subprocess.run([sys.executable, "-m", "preftune.cli", *argv], env=env, capture_output=True,
                               text=True, timeout=120)
            codes.append((argv[1], want, p.returncode, p.stderr.strip().splitlines()[-1:]))
    finally:
        busy.kill()
        busy.wait()
    wrong = [c for c in codes if c[1] != c[2]]
    assert not wrong, wrong
