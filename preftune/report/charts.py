"""Charts of metrics.jsonl (matplotlib, headless: a Figure on the Agg canvas, no pyplot state).

Training records are lines; evaluation records (`eval/*`) are drawn as marked points, on their own
chart and beside the training metric they mirror (eval/reward on the reward chart). Each chart is
drawn only when the run logged one of its metrics, so GRPO, DPO and SFT runs get their own sets.
"""
from __future__ import annotations

import fnmatch
import json
import math
from pathlib import Path

# (file name, title, metric patterns); `*` matches any suffix
CHARTS = [
    ("reward", "reward (train) and eval/reward (held-out, greedy)", ["reward", "eval/reward"]),
    ("reward_per_function", "reward per function (mean)",
     ["rewards/*/mean", "eval/rewards/*/mean"]),
    ("reward_std", "reward_std, reward_group_std, frac_reward_zero_std",
     ["reward_std", "reward_group_std", "frac_reward_zero_std"]),
    ("loss", "loss", ["loss"]),
    ("kl", "kl", ["kl"]),
    ("entropy", "entropy", ["entropy"]),
    ("completion_length", "completions: mean, min, max length",
     ["completions/mean_length", "completions/min_length", "completions/max_length",
      "eval/completions/mean_length"]),
    ("clip_ratio", "clip ratios", ["clip_ratio/*"]),
    ("dpo_margins", "rewards/margins", ["rewards/margins", "eval/rewards/margins"]),
    ("dpo_accuracies", "rewards/accuracies", ["rewards/accuracies", "eval/rewards/accuracies"]),
    ("dpo_rewards", "rewards/chosen, rewards/rejected", ["rewards/chosen", "rewards/rejected"]),
    ("dpo_logps", "logps/chosen, logps/rejected", ["logps/chosen", "logps/rejected"]),
    ("learning_rate", "learning_rate", ["learning_rate"]),
    ("grad_norm", "grad_norm", ["grad_norm"]),
    ("tokens_per_second", "tokens_per_second", ["tokens_per_second"]),
    ("eval", "held-out evaluation", ["eval/*"]),
]
SKIP = {"eval/num_prompts", "eval/num_pairs"}


def read_metrics(path: Path) -> list[dict]:
    """The records of metrics.jsonl; a last line cut short by a running or killed writer is
    skipped."""
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "step" in rec:
            out.append(rec)
    return out


def series(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """metric -> (steps, values), finite numbers only; a resumed run's rewritten steps keep the last
    value."""
    by_key: dict[str, dict[int, float]] = {}
    for r in records:
        for k, v in r.items():
            if k != "step" and k not in SKIP and isinstance(v,
                                                            (int,
                                                             float)) and not isinstance(v, bool) \
                    and math.isfinite(v):
                by_key.setdefault(k, {})[int(r["step"])] = float(v)
    return {k: (sorted(d), [d[s] for s in sorted(d)]) for k, d in by_key.items()}


def _matches(key: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


def draw(data: dict[str, tuple[list[int], list[float]]],
         out_dir: Path) -> list[tuple[str, str, Path]]:
    """One PNG per chart whose metrics exist -> [(name, title, path)]."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir.mkdir(parents=True, exist_ok=True)
    made = []
    for name, title, patterns in CHARTS:
        keys = [k for k in data if _matches(k, patterns)]
        if not keys:
            continue
        fig = Figure(figsize=(6.4, 3.4), dpi=80)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for k in sorted(keys, key=lambda k: (k.startswith("eval/"), k)):
            steps, values = data[k]
            if k.startswith("eval/"):  # evaluation points: marked, joined by a dashed line
                ax.plot(steps, values, "o--", markersize=5, linewidth=1, label=k)
            else:
                ax.plot(steps, values, "-", linewidth=1.2, marker="." if len(steps) < 3 else None,
                        label=k)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        made.append((name, title, path))
    return made
