"""The promotion gate: compare a checkpoint with a baseline on the same held-out prompts and decide.

Figures per model: greedy `reward` (mean summed reward), `rewards/<fn>/mean`,
`completions/mean_length`, and with eval.num_samples k > 1 the `sampled/…` figures (pass@k, mean@k
of 0/1 rewards). The comparison is paired by prompt: improvement = mean over prompts of (checkpoint
− baseline) greedy reward, with a one-sided percentile-bootstrap lower bound at `gate.confidence`;
length growth = checkpoint / baseline mean greedy completion length. With held-out pairs
(`evaluation/pairs.py`) the figures are TRL's DPO metrics and the paired series is 1/0 per pair
ranked right (reward accuracy).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from preftune.config import GateConfig
from preftune.data.traces import display_path, is_local, resolve_files
from preftune.errors import UserError
from preftune.evaluation.stats import bootstrap_mean_bounds


@dataclass
class Verdict:
    passed: bool
    reason: str
    checks: list[dict] = field(default_factory=list)  # name, value, threshold, passed


def compare(ckpt_total, base_total, gate: GateConfig, seed: int, ckpt_length: float | None = None,
            base_length: float | None = None, series: str = "reward") -> dict:
    """Paired comparison of checkpoint and baseline per held-out item (n,): the greedy reward per
    prompt, or (series "pair accuracy") 1/0 per held-out pair ranked right/wrong."""
    valid = ~(ckpt_total.isnan() | base_total.isnan())
    diffs = (ckpt_total - base_total)[valid]  # (m,)
    lo, hi = bootstrap_mean_bounds(diffs, gate.confidence, gate.bootstrap_samples, seed)
    growth = None
    if ckpt_length is not None and base_length is not None:
        growth = ckpt_length / base_length if base_length > 0 else float("inf")
    return {"series": series, "improvement": diffs.mean().item() if diffs.numel() else float("nan"),
            "improvement_lower": lo, "improvement_upper": hi, "confidence": gate.confidence,
            "paired_prompts": int(valid.sum()), "length_growth": growth}


def check_gate(gate: GateConfig, has_baseline: bool, pairs: bool = False) -> None:
    """Thresholds that compare with a baseline need one, and each threshold needs its kind of
    held-out data (prompts or pairs): a config error, found before any work."""
    for key in ("min_improvement", "max_length_growth"):
        if getattr(gate, key) is not None and not has_baseline:
            raise UserError("needs a baseline: pass --baseline PATH", where=f"gate.{key}")
    if pairs and gate.min_reward is not None:
        raise UserError("scores generated completions, and data.eval is a pairs file: gate on "
                        "gate.min_accuracy (the pairs' rewards/accuracies) instead",
                        where="gate.min_reward")
    if pairs and gate.max_length_growth is not None:
        raise UserError("compares generated lengths, and held-out pairs generate nothing",
                        where="gate.max_length_growth")
    if not pairs and gate.min_accuracy is not None:
        raise UserError("needs held-out pairs: data.eval a pairs file (prompt, chosen, rejected)",
                        where="gate.min_accuracy")


def decide(gate: GateConfig, ckpt: dict, comparison: dict | None) -> Verdict:
    """Every set threshold must hold; the reason names each check that failed (or all that
    passed)."""
    checks = []

    def check(name, value, threshold, ok, text):
        ok = ok and not (isinstance(value, float) and math.isnan(value))
        checks.append({"name": name, "value": value, "threshold": threshold,
                       "passed": bool(ok), "text": text})

    if gate.min_reward is not None:
        r = ckpt["reward"]
        check("min_reward", r, gate.min_reward, r >= gate.min_reward,
              f"reward {r:.4f} vs gate.min_reward {gate.min_reward}")
    if gate.min_accuracy is not None:
        a = ckpt["rewards/accuracies"]
        check("min_accuracy", a, gate.min_accuracy, a >= gate.min_accuracy,
              f"rewards/accuracies {a:.4f} vs gate.min_accuracy {gate.min_accuracy}")
    if gate.min_improvement is not None:
        lo = comparison["improvement_lower"]
        check("min_improvement", lo, gate.min_improvement, lo > gate.min_improvement,
              f"{_series(comparison)}improvement {comparison['improvement']:+.4f}, "
              f"{gate.confidence:.0%} lower bound {lo:+.4f} vs gate.min_improvement "
              f"{gate.min_improvement}")
    if gate.max_length_growth is not None:
        g = comparison["length_growth"]
        check("max_length_growth", g, gate.max_length_growth, g <= gate.max_length_growth,
              f"completion length growth {g:.3f}x vs gate.max_length_growth "
              f"{gate.max_length_growth}")
    failed = [c["text"] for c in checks if not c["passed"]]
    if failed:
        return Verdict(False, "failed: " + "; ".join(failed), checks)
    if not checks:
        return Verdict(True, "passed: no gate threshold is set", checks)
    return Verdict(True, "passed: " + "; ".join(c["text"] for c in checks), checks)


def _series(comparison: dict) -> str:
    return "" if comparison["series"] == "reward" else comparison["series"] + " "


def data_fingerprint(path: str) -> str:
    """sha256 over the training files: name + content for local files, name + size + ETag for remote
    ones."""
    fs, files = resolve_files(path)
    h = hashlib.sha256()
    for f in files:
        h.update(display_path(fs, f).encode())
        if is_local(fs):
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        else:
            info = fs.info(f)
            h.update(f"{info.get('size')}|{info.get('ETag') or info.get('etag') or ''}".encode())
    return h.hexdigest()
