"""bench/bench_startup.py's reading of `python -X importtime` (self times by package, the packages a
jsonl GRPO run must not import) and the command it times; the runs themselves belong to the bench."""
from __future__ import annotations

import pytest

from bench import bench_startup

IMPORTTIME = """\
import time: self [us] | cumulative | imported package
import time:      1000 |       1000 | preftune.errors
import time:   2000000 |    2500000 |   torch
import time:    500000 |     500000 |     torch._C
import time:    250000 |     250000 |       pyarrow.lib
import time:    100000 |     350000 |     pyarrow
import time:     30000 |      30000 | preftune.data.inspect
some other stderr line
"""


def test_import_profile_sums_self_times_by_package_and_names_what_a_jsonl_run_does_not_need():
    p = bench_startup.import_profile(IMPORTTIME)
    assert p["top"] == {"torch": 2.5, "pyarrow": 0.35, "preftune": 0.031}
    assert p["total_s"] == pytest.approx(2.881)
    assert p["not_needed_but_imported"] == ["pyarrow", "preftune.data.inspect"]
    assert bench_startup.import_profile("import time:      10 |      10 | torch\n")["not_needed_but_imported"] == []


def test_the_timed_command_is_the_issue_s_restart(tmp_path):
    cmd = bench_startup.command(tmp_path / "o", ["seed=3"], importtime=True)
    assert cmd[1:5] == ["-X", "importtime", "-m", "preftune"]
    assert cmd[5:7] == ["train", "examples/grpo.yaml"] and "max_steps=1" in cmd and cmd[-1] == "seed=3"
    assert "-X" not in bench_startup.command(tmp_path / "o", [])
