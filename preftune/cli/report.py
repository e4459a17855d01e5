"""`preftune report RUN_DIR [-o OUT]`: charts (PNG) and report.html in RUN_DIR/report/ (or OUT).

It reads only what the run writes as it goes (metrics.jsonl, config.yaml, data_report.json, and
final/eval.json from `preftune eval`), so it works on a running, preempted or finished run.
"""
from __future__ import annotations

import json
from pathlib import Path

from preftune.atomic import atomic_write
from preftune.errors import EXIT_OK, UserError
from preftune.report.charts import draw, read_metrics, series
from preftune.report.page import render, status_line


def add_parser(sub) -> None:
    rp = sub.add_parser("report",
                        help="charts and an HTML page of a run (running, preempted or finished)")
    rp.add_argument("run_dir", help="the run's output_dir")
    rp.add_argument("-o", "--output", default=None,
                    help="folder for the PNGs and report.html (default RUN_DIR/report)")
    rp.set_defaults(handler=run_report)


def make_report(run_dir: Path, out: Path) -> Path:
    import yaml


    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError("no metrics.jsonl: not a preftune run folder (or nothing logged yet)",
                        where=str(run_dir))
    records = read_metrics(metrics)
    charts = draw(series(records), out)
    max_steps = None
    if (run_dir / "config.yaml").is_file():
        max_steps = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("max_steps")
    finished = (run_dir / "final" / "MANIFEST.json").is_file()
    evals = [r for r in records if any(k.startswith("eval/") for k in r)]
    eval_file = run_dir / "final" / "eval.json"
    eval_report = json.loads(eval_file.read_text()) if eval_file.is_file() else None
    page = render(run_dir, charts, status_line(records, max_steps, finished),
                  evals[-1] if evals else None, eval_report,
                  eval_steps=[int(r["step"]) for r in evals])
    path = out / "report.html"
    atomic_write(path, page)
    return path


def run_report(args) -> int:
    run_dir = Path(args.run_dir)
    out = Path(args.output) if args.output else run_dir / "report"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("preftune report needs matplotlib: pip install 'preftune[report]'",
                        where="report") from None
    path = make_report(run_dir, out)
    print(f"report: {path}\ncharts: {out}/*.png")
    return EXIT_OK
