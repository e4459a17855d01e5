"""2 ranks compute like 1 process in every layout of the log-prob pass (float64, FSDP2 over gloo):
each rank's rows' log-probs, and the gradients summed over the ranks, equal one process's on the
whole batch, including a rank that holds no rows (it joins the collectives with a zero-weight pass);
with routing replay too (a mixture of experts running given experts)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.distributed.ranks import ROOT, free_port, rank_env


def run_ranks(tmp_path, which: str, n_rows: int) -> list[dict]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.distributed.layouts", str(tmp_path), which, str(n_rows)],
                              cwd=ROOT, env=rank_env(r, 2, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("which, n_rows", [("own", 7), ("own", 1), ("hf", 7), ("glm4", 7),
                                           ("qwen3-moe", 7), ("qwen3-moe-replay", 7)])
def test_two_ranks_compute_like_one_in_every_layout(which, n_rows, tmp_path):
    ranks = run_ranks(tmp_path, which, n_rows)
    layouts = [k for k in ranks[0]["results"] if "/" not in k]
    assert layouts == (["shared", "causal", "plain"] if which != "hf" else ["hf"])
    for name in layouts:
        want_logps, want_grads = ranks[0]["results"][name + "/one"]
        for r in ranks:
            lo, hi = r["share"]
            logps, grads = r["results"][name]
            if hi > lo:
                width = logps.size(1)
                assert torch.allclose(logps, want_logps[lo:hi, :width], atol=1e-12, rtol=0), name
                assert (want_logps[lo:hi, width:] == 0).all()
            assert grads.keys() == want_grads.keys()
            for k in grads:
                assert torch.allclose(grads[k], want_grads[k], atol=1e-11, rtol=1e-9), (name, k)
        assert any(g.abs().max() > 1e-3 for g in want_grads.values())
