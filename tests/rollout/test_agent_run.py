"""Online GRPO with an environment, end to end through `preftune.train`: the first turn is a forced
tool call (the tiny model would not write one), later turns come from the own sampler; the
environment's get_reward is the only reward; TRL's tool metrics, the trajectory dump, and the
evaluation pass through the same environment."""
from __future__ import annotations

import json
import shutil

import torch

import preftune
from preftune.rollout.engine import SamplerEngine
from preftune.rollout.sampler import assemble
from tests.conftest import MODEL_DIR
from tests.rollout.test_agent import TEMPLATE, Env, call


class Counter(Env):
    """test_agent's environment, started at the row's `start` (and saying so in the prompt)."""

    def reset(self, **row) -> str | None:
        self.total = int(row["start"])
        return f" (start at {row['start']})"


def test_an_environment_run_trains_and_reports_its_tools(tmp_path, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(MODEL_DIR, model)
    conf = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(conf | {"chat_template": TEMPLATE}))
    real = SamplerEngine.generate

    def forced(self, prompts, positions=None, *, turn=0, **kw):
        if turn > 0:  # later turns: the tiny model itself, from token ids
            return real(self, prompts, positions, turn=turn, **kw)
        tok = tok_holder[0]
        ids = torch.tensor([tok(call("bump", by=2), add_special_tokens=False).input_ids + [tok.eos_token_id]]
                           * (len(prompts) * kw["num_generations"]))
        return assemble(ids[:, :1], ids[:, :1], ids, kw["eos_id"])

    from transformers import AutoTokenizer

    tok_holder = [AutoTokenizer.from_pretrained(model)]
    monkeypatch.setattr(SamplerEngine, "generate", forced)
    rows = [{"input": [{"role": "user", "content": f"q{i}"}], "start": i} for i in range(4)]
    result = preftune.train({}, overrides={
        "model.name_or_path": str(model), "output_dir": str(tmp_path / "run"), "max_steps": 2, "save_steps": 0,
        "log.progress_bar": False, "grpo.prompts_per_step": 2, "grpo.num_generations": 2,
        "grpo.max_completion_length": 80, "data.max_prompt_length": 32, "grpo.log_trajectories": 2,
        "grpo.reward_funcs": []}, train_data=rows, eval_data=rows[:2], environment_factory=Counter)
    m = result.metrics
    assert m["tools/call_frequency"] == 1.0 and m["tools/failure_frequency"] == 0.0
    assert m["tools/turns"] == 2.0 and 0 < m["tools/token_share"] < 1
    assert "rewards/Counter/mean" in m
    # held-out tasks run through the environment too: reset at their start, then the forced bump by 2
    assert [e["eval/rewards/Counter/mean"] for e in result.eval][0] >= 2.5
    dumped = [json.loads(line) for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert len(dumped) == 4 and {d["step"] for d in dumped} == {1, 2}
    d = dumped[0]
    assert d["messages"][1] == {"role": "tool", "name": "bump", "content": str(int(d["reward"]))}
    assert "(start at" in d["prompt"] and "[1 tools]" in d["prompt"]
    assert 0 in d["trained"] and d["trained"][len(d["trained"]) - 1] == 1


class Shelf:
    """A second environment: its only tool is `count`, so the forced `bump` fails here."""

    def reset(self, **row) -> str | None:
        return None

    def count(self) -> int:
        """How many items are on the shelf."""
        return 0


def test_each_row_acts_in_the_environment_its_column_names(tmp_path, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(MODEL_DIR, model)
    conf = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(conf | {"chat_template": TEMPLATE}))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    real = SamplerEngine.generate

    def forced(self, prompts, positions=None, *, turn=0, **kw):
        if turn > 0:
            return real(self, prompts, positions, turn=turn, **kw)
        ids = torch.tensor([tok(call("bump", by=2), add_special_tokens=False).input_ids
                            + [tok.eos_token_id]] * (len(prompts) * kw["num_generations"]))
        return assemble(ids[:, :1], ids[:, :1], ids, kw["eos_id"])

    monkeypatch.setattr(SamplerEngine, "generate", forced)
    rows = [{"input": [{"role": "user", "content": f"q{i}"}], "start": i,
             "environment": "counter" if i % 2 == 0 else "shelf"} for i in range(4)]
    result = preftune.train({}, overrides={
        "model.name_or_path": str(model), "output_dir": str(tmp_path / "run"), "max_steps": 1,
        "save_steps": 0, "log.progress_bar": False, "grpo.prompts_per_step": 4,
        "grpo.num_generations": 2, "grpo.max_completion_length": 80, "data.max_prompt_length": 32,
        "grpo.reward_funcs": []}, train_data=rows,
        environment_factory={"counter": Counter, "shelf": Shelf})
    m = result.metrics
    # half the rows act in a Shelf, where `bump` is not a tool: their calls fail
    assert m["tools/call_frequency"] == 1.0 and m["tools/failure_frequency"] == 0.5
    assert "rewards/environment/mean" in m  # the mapping's get_reward: the Counters' only
