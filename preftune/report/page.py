"""The self-contained HTML report: charts embedded as base64 PNGs, the resolved config, the data
report, the last evaluation, the gate verdict (`eval.json`) and a few sampled trajectories per
evaluation point (`trajectories.jsonl`), when there are."""
from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from preftune.data.data_report import DATA_REPORT


def _pre(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


def _table(rows: list[tuple], head: tuple) -> str:
    th = "".join(f"<th>{html.escape(str(h))}</th>" for h in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows
    )
    return f"<table><tr>{th}</tr>{body}</table>"


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return "-" if x is None else str(x)


def status_line(records: list[dict], max_steps: int | None, finished: bool) -> str:
    last = max((r["step"] for r in records), default=0)
    if finished:
        return f"finished: step {last} of {max_steps}"
    return f"not finished (running or preempted): last logged step {last} of {max_steps}"


def gate_section(report: dict) -> str:
    verdict, reason = report.get("verdict", "?"), report.get("reason", "")
    parts = [f"<p class='{html.escape(verdict)}'><b>{html.escape(verdict.upper())}</b>: "
             f"{html.escape(reason)}</p>"]
    ck, base = report["metrics"]["checkpoint"], report["metrics"].get("baseline")
    rows = [(k, ck[k], (base or {}).get(k)) for k in ck]
    parts.append(_table(rows, ("figure", "checkpoint", "baseline")))
    if report.get("comparison"):
        parts.append(_table(list(report["comparison"].items()), ("comparison", "value")))
    if report.get("checks"):
        parts.append(
            _table(
                [
                    (c["name"], c["value"], c["threshold"], "pass" if c["passed"] else "fail")
                    for c in report["checks"]
                ],
                ("check", "value", "threshold", "result"),
            )
        )
    return "".join(parts)


TRAJECTORIES = "trajectories.jsonl"  # grpo.log_trajectories (rollout/agent.dump_trajectories)
PER_POINT = 3  # trajectories shown per evaluation point


def trajectory_points(rows: list[dict], eval_steps: list[int]) -> list[tuple[int, list[dict]]]:
    """For each evaluation step, the first dumped batch at or after it (else the last batch):
    (step, its first PER_POINT rows), each batch once, in step order."""
    by_step: dict[int, list[dict]] = {}
    for r in rows:
        by_step.setdefault(int(r["step"]), []).append(r)
    steps = sorted(by_step)
    if not steps:
        return []
    picked = {next((s for s in steps if s >= e), steps[-1]) for e in eval_steps} or {steps[-1]}
    return [(s, by_step[s][:PER_POINT]) for s in sorted(picked)]


def _message(m: dict) -> str:
    role = m.get("role", "?")
    if role == "tool":
        return (f"<div class='tool'><b>tool {html.escape(str(m.get('name', '')))}</b> "
                f"{html.escape(str(m.get('content', '')))}</div>")
    calls = "".join(
        f"<div class='call'><b>call</b> {html.escape(c['function']['name'])}"
        f"({html.escape(json.dumps(c['function'].get('arguments', {})))})</div>"
        for c in m.get("tool_calls") or [])
    return f"<div class='turn'><b>{html.escape(role)}</b> {html.escape(str(m.get('content', '')))}"\
           f"</div>{calls}"


def trajectory_section(rows: list[dict], eval_steps: list[int]) -> str:
    """A few sampled trajectories per evaluation point: the prompt's end, each turn, the tool calls
    and results set apart, the reward."""
    parts = []
    for step, batch in trajectory_points(rows, eval_steps):
        parts.append(f"<h3>step {step}</h3>")
        for r in batch:
            head = (f"reward {_fmt(float(r['reward']))} · {r.get('turns', 1)} turn(s) · "
                    f"{r.get('calls', 0)} call(s), {r.get('failures', 0)} failed"
                    + (" · truncated" if r.get("truncated") else ""))
            body = "".join(_message(m) for m in r.get("messages", []))
            parts.append(f"<div class='traj'><p>{html.escape(head)}</p>"
                         f"{_pre(str(r.get('prompt', ''))[-200:])}{body}</div>")
    return "".join(parts)


def render(run_dir: Path, charts: list[tuple[str, str, Path]], status: str, last_eval: dict | None,
           eval_report: dict | None, eval_steps: list[int] = ()) -> str:
    parts = [f"<h1>preftune run: {html.escape(str(run_dir))}</h1>", f"<p>{html.escape(status)}</p>"]
    if eval_report is not None:
        parts += ["<h2>Gate verdict</h2>", gate_section(eval_report)]
    if last_eval:
        step = last_eval.get("step")
        rows = [(k, v) for k, v in last_eval.items() if k != "step"]
        parts += [f"<h2>Final evaluation (step {step})</h2>", _table(rows, ("metric", "value"))]
    parts.append("<h2>Charts</h2>")
    for name, title, path in charts:
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<figure><img alt='{html.escape(title)}' src='data:image/png;base64,{data}'>"
                     f"<figcaption>{html.escape(title)}</figcaption></figure>")

    dumped = run_dir / TRAJECTORIES
    if dumped.is_file():
        rows = [json.loads(x) for x in dumped.read_text().splitlines() if x.strip()]
        parts += ["<h2>Trajectories</h2>", trajectory_section(rows, list(eval_steps))]
    for title, name in (("Resolved config", "config.yaml"), ("Data report", DATA_REPORT)):
        f = run_dir / name
        if f.is_file():
            text = f.read_text()
            if name.endswith(".json"):
                text = json.dumps(json.loads(text), indent=1)
            parts += [f"<h2>{title}</h2>", _pre(text)]
    style = (
        "body{font-family:sans-serif;max-width:1000px;margin:auto}figure{display:inline-block;margin:4px}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px "
        "6px;text-align:left}"
        "pre{background:#f6f6f6;padding:8px;overflow:auto}.pass{color:#060}.fail{color:#a00}"
        ".traj{border-left:3px solid #ccc;margin:8px 0;padding-left:8px}.call{background:#eef;"
        "margin-left:16px}.tool{background:#efe;margin-left:16px;font-family:monospace}"
    )
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>preftune "
            f"report</title><style>{style}</style></head><body>{''.join(parts)}</body></html>\n")
