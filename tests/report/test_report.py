"""`preftune report`: charts for GRPO, DPO and SFT runs with eval points marked, one self-contained HTML
page with config, data report, last eval and gate verdict; works on unfinished runs."""
from __future__ import annotations

import json
import re

import pytest

from preftune.cli.command import main
from preftune.errors import EXIT_USER
from preftune.report.charts import read_metrics, series

PNG = b"\x89PNG\r\n\x1a\n"


def _run(tmp_path, records, *, finished=False, eval_report=None, partial_line=False):
    run = tmp_path / "run"
    run.mkdir()
    text = "".join(json.dumps(r) + "\n" for r in records)
    if partial_line:
        text += '{"step": 9, "loss": 0.'  # a writer cut off mid-line
    (run / "metrics.jsonl").write_text(text)
    (run / "config.yaml").write_text("algorithm: grpo\nmax_steps: 10\nnote: '<script>'\n")
    (run / "data_report.json").write_text(json.dumps({"prompts": 300}))
    if finished:
        (run / "final").mkdir()
        (run / "final" / "MANIFEST.json").write_text("{}")
    if eval_report:
        (run / "final" / "eval.json").write_text(json.dumps(eval_report))
    return run


def grpo_records(n=6):
    recs = [{"step": 0, "eval/reward": 0.3, "eval/rewards/accuracy/mean": 0.3, "eval/num_prompts": 100}]
    for s in range(1, n + 1):
        recs.append({"step": s, "reward": 0.1 * s, "rewards/accuracy/mean": 0.1 * s, "reward_std": 0.2, "loss": 0.01,
                     "kl": 0.0, "entropy": 1.0, "completions/mean_length": 3.0, "clip_ratio/region_mean": 0.01,
                     "learning_rate": 1e-4, "grad_norm": None, "tokens_per_second": 1000.0, "step_time": 0.1})
    recs.append({"step": n, "eval/reward": 0.6, "eval/rewards/accuracy/mean": 0.6, "eval/num_prompts": 100})
    return recs


def test_grpo_run_charts_and_page(tmp_path, capsys):
    verdict = {"verdict": "pass", "reason": "passed: reward 0.6 vs gate.min_reward 0.5",
               "metrics": {"checkpoint": {"reward": 0.6}, "baseline": {"reward": 0.3}},
               "comparison": {"improvement": 0.3}, "checks": [{"name": "min_reward", "value": 0.6, "threshold": 0.5,
                                                               "passed": True}]}
    run = _run(tmp_path, grpo_records(), finished=True, eval_report=verdict)
    assert main(["report", str(run)]) == 0
    out = run / "report"
    names = sorted(p.stem for p in out.glob("*.png"))
    assert names == sorted(["reward", "reward_per_function", "reward_std", "loss", "kl", "entropy",
                            "completion_length", "clip_ratio", "learning_rate", "tokens_per_second", "eval"])
    assert all(p.read_bytes().startswith(PNG) and p.stat().st_size > 2000 for p in out.glob("*.png"))
    page = (out / "report.html").read_text()
    assert len(re.findall(r"src='data:image/png;base64,", page)) == len(names)  # self-contained
    assert "finished: step 6 of 10" in page and "PASS" in page and "gate.min_reward 0.5" in page
    assert "Final evaluation (step 6)" in page and "&lt;script&gt;" in page and "<script>" not in page
    assert '&quot;prompts&quot;: 300' in page


def test_dpo_and_sft_runs_get_their_own_charts(tmp_path):
    recs = [{"step": s, "loss": 0.7 - 0.01 * s, "rewards/margins": 0.1 * s, "rewards/accuracies": 0.5,
             "rewards/chosen": 0.1, "rewards/rejected": -0.1, "logps/chosen": -3.0, "logps/rejected": -4.0,
             "learning_rate": 1e-4} for s in range(1, 4)]
    run = _run(tmp_path, recs)
    assert main(["report", str(run)]) == 0
    names = {p.stem for p in (run / "report").glob("*.png")}
    assert {"dpo_margins", "dpo_accuracies", "dpo_rewards", "dpo_logps", "loss"} <= names
    assert "reward_per_function" not in names and "reward" not in names  # rewards/* are DPO's, not per function


def test_unfinished_run_with_a_cut_line_and_resumed_steps(tmp_path):
    recs = grpo_records(4)[:-1] + [{"step": 3, "reward": 9.0}]  # a resume rewrote step 3
    run = _run(tmp_path, recs, partial_line=True)
    assert len(read_metrics(run / "metrics.jsonl")) == len(recs)
    steps, values = series(read_metrics(run / "metrics.jsonl"))["reward"]
    assert steps == [1, 2, 3, 4] and values[2] == 9.0
    assert main(["report", str(run), "-o", str(tmp_path / "elsewhere")]) == 0
    page = (tmp_path / "elsewhere" / "report.html").read_text()
    assert "not finished (running or preempted): last logged step 4 of 10" in page and "Gate verdict" not in page


def test_not_a_run_folder_is_exit_78(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == EXIT_USER
    assert "no metrics.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("algorithm", ["sft"])
def test_report_of_a_real_sft_run(make_config, traces_file, algorithm):
    from preftune.run.loop import train

    cfg = make_config(f"algorithm={algorithm}", f"data.train={traces_file}", "sft.batch_size=4",
                      "max_steps=3", "sft.max_length=24", "eval.split=0.5")
    train(cfg)
    assert main(["report", cfg.output_dir]) == 0
    page = open(f"{cfg.output_dir}/report/report.html").read()
    assert "finished: step 3 of 3" in page and "Final evaluation (step 3)" in page


def test_trajectories_are_shown_per_eval_point_with_the_calls_set_apart(tmp_path):
    run = _run(tmp_path, grpo_records(4))  # evaluations at steps 0 and 4
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    rows = [{"step": s, "row": i, "prompt": f"<user>{s}+{i}=<script>", "reward": float(i),
             "turns": 2, "calls": 1, "failures": 0, "truncated": False,
             "messages": [{"role": "assistant", "content": "<tool_call>...", "tool_calls": [call]},
                          {"role": "tool", "name": "add", "content": "3"},
                          {"role": "assistant", "content": f"answer-{s}-{i}"}]}
            for s in (1, 2, 3, 4) for i in range(5)]
    (run / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(run)]) == 0
    page = (run / "report" / "report.html").read_text()
    # step 0's point shows the first batch after it (step 1), step 4's its own; 3 rows each
    assert "<h3>step 1</h3>" in page and "<h3>step 4</h3>" in page and "<h3>step 2</h3>" not in page
    assert page.count("answer-1-") == 3 and page.count("answer-4-") == 3
    assert page.count("<div class='call'><b>call</b> add({&quot;a&quot;: 1, &quot;b&quot;: 2})") == 6
    assert page.count("<div class='tool'><b>tool add</b> 3</div>") == 6
    assert "reward 2 · 2 turn(s) · 1 call(s), 0 failed" in page and "<script>" not in page
