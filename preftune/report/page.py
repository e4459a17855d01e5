"""The self-contained HTML report: charts embedded as base64 PNGs, the resolved config, the data
report, the last evaluation and, when there is one, the gate verdict (`eval.json`)."""
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


def render(run_dir: Path, charts: list[tuple[str, str, Path]], status: str, last_eval: dict | None,
           eval_report: dict | None) -> str:
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
    )
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>preftune "
            f"report</title><style>{style}</style></head><body>{''.join(parts)}</body></html>\n")
