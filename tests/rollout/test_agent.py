"""The multi-turn tool loop (`rollout/agent.py`, `rollout/tools.py`): token-in/token-out exactly,
tool tokens masked and stop tokens kept, every failing-tool case, bad input at start."""
from __future__ import annotations

import contextlib
import json
import time

import pytest
import torch

from preftune.config import GRPOConfig
from preftune.errors import UserError
from preftune.model.logps import completion_logps
from preftune.rollout.agent import ToolLoop, ToolTurns, Trajectory, build_agent
from preftune.rollout.engine import SamplerEngine
from preftune.rollout.sampler import assemble as assemble_turn
from preftune.rollout.tools import Call, Environments, make_tool, parse_calls, run_call
from tests.conftest import MODEL_DIR

# a tool-capable template for the byte-level tiny tokenizer: hermes-style calls, a tool turn "T:"
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}U:{{ m['content'] }}\n"
            "{% elif m['role'] == 'assistant' %}A:{{ m['content'] }}{% if m.get('tool_calls') %}<tool_call>{% endif %}"
            "{{ eos_token }}\n{% elif m['role'] == 'tool' %}T:{{ m['content'] }}\n{% endif %}{% endfor %}"
            "{% if tools %}[{{ tools | length }} tools]{% endif %}{% if add_generation_prompt %}A:{% endif %}")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(MODEL_DIR)
    t.chat_template = TEMPLATE
    return t


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: ignored
    """
    raise RuntimeError("kaput")


def slow(x: int) -> int:
    """Takes too long.

    Args:
        x: ignored
    """
    time.sleep(5)
    return x


async def add_async(a: int, b: int) -> int:
    """Add, asynchronously.

    Args:
        a: the first
        b: the second
    """
    return a + b


def call(name, **args) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


class Scripted:
    """An engine that answers each row's k-th turn with scripted text (+ the stop token), and
    records every prompt (token ids) it was asked to continue."""

    with_logps, tp = True, 1

    def __init__(self, tok, script: list[list[str]]):
        self.tok, self.script, self.seen, self.turn_of = tok, script, [], {}

    @contextlib.contextmanager
    def conversation(self):
        yield None

    def generate(self, prompts, positions, *, num_generations, max_new_tokens, eos_id, pad_id, turn=0, **kw):
        rows = []
        for p, pos in zip(prompts, positions):
            for g in range(num_generations):
                row = pos * num_generations + g if num_generations > 1 else pos
                k = self.turn_of.get(row, 0)
                self.turn_of[row] = k + 1
                self.seen.append((row, k, list(p)))
                rows.append(self.tok(self.script[row][k], add_special_tokens=False).input_ids + [eos_id])
        width = max(len(r) for r in rows)
        tokens = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])[:, :max_new_tokens]
        ro = assemble_turn(torch.ones(len(rows), 1, dtype=torch.long), torch.ones(len(rows), 1, dtype=torch.long),
                           tokens, eos_id)
        ro.sampling_logps = -torch.arange(1, ro.completion_ids.numel() + 1).view_as(ro.completion_ids).float() / 100
        return ro


def loop(tok, **kw) -> ToolLoop:
    cfg = GRPOConfig(max_completion_length=kw.pop("budget", 200), **kw)
    return ToolLoop(tok, cfg, "hermes", ToolTurns(tok, cfg.max_tool_response_length))


def test_three_turns_train_exactly_the_sampled_tokens(tok):
    """Each turn's prompt is the previous prompt + the sampled ids + the tool turn's ids; the
    rollout holds exactly that; tool tokens are 0 in the tool mask, every stop token 1."""
    script = [[call("add", a=1, b=2), call("add", a=3, b=4), "it is 10"], ["no tools"]]
    eng, prompt = Scripted(tok, script), tok("U:q\nA:", add_special_tokens=False).input_ids
    rows = [Trajectory(list(prompt)) for _ in range(2)]
    ro = loop(tok).run(eng, rows, [{"add": make_tool(add, "t")}] * 2, 2, [0], eos_id=tok.eos_token_id,
                       pad_id=tok.pad_token_id)
    enc = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
    eos = tok.eos_token_id
    turns = [enc(s) + [eos] for s in script[0]]
    tools = [enc("\nT:3\nA:"), enc("\nT:7\nA:")]
    want = turns[0] + tools[0] + turns[1] + tools[1] + turns[2]
    n = int(ro.completion_mask[0].sum())
    assert ro.completion_ids[0, :n].tolist() == want
    assert ro.tool_mask[0, :n].tolist() == [1] * len(turns[0]) + [0] * len(tools[0]) + [1] * len(turns[1]) + \
        [0] * len(tools[1]) + [1] * len(turns[2])
    stops = (ro.completion_ids[0, :n] == eos).nonzero().squeeze(1)
    assert len(stops) == 3 and ro.loss_mask()[0, stops].tolist() == [1, 1, 1]  # every turn's stop token trains
    # what the engine was asked to continue: never re-tokenized, exactly the ids so far
    asked = {(row, k): p for row, k, p in eng.seen}
    assert asked[(0, 1)] == prompt + turns[0] + tools[0]
    assert asked[(0, 2)] == prompt + turns[0] + tools[0] + turns[1] + tools[1]
    assert (1, 1) not in asked and int(ro.completion_mask[1].sum()) == len(enc("no tools")) + 1
    assert rows[0].turns == 3 and rows[0].calls == 2 and rows[0].failures == 0 and not rows[0].truncated
    assert [m["role"] for m in rows[0].messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    # the parsed calls ride on their assistant message, as TRL's completions show them
    assert rows[0].messages[0]["tool_calls"] == [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    assert "tool_calls" not in rows[0].messages[4]
    # the engine's log-probs on sampled tokens, 0 on tool tokens
    lp = ro.sampling_logps[0, :n]
    assert (lp[ro.tool_mask[0, :n] == 0] == 0).all() and (lp[ro.tool_mask[0, :n] == 1] < 0).all()


def test_the_own_sampler_continues_from_token_ids(tok, model):
    """With the tiny model behind the own sampler: after a forced tool call, the trainer's log-probs
    of the sampled turn equal the sampler's, so the training pass sees what was sampled."""
    forced = tok(call("add", a=2, b=2), add_special_tokens=False).input_ids + [tok.eos_token_id]

    class Forced(SamplerEngine):
        def generate(self, prompts, positions=None, *, turn=0, **kw):
            if turn == 0:  # the first turn: a call the tiny model would not write by itself
                ids = torch.tensor([forced] * (len(prompts) * kw["num_generations"]))
                return assemble_turn(ids[:, :1], ids[:, :1], ids, kw["eos_id"])
            return super().generate(prompts, positions, turn=turn, **kw)

    eng = Forced(with_logps=True)
    prompt = tok("U:q\nA:", add_special_tokens=False).input_ids
    rows = [Trajectory(list(prompt)) for _ in range(2)]
    ro = loop(tok, budget=90).run(
        eng, rows, [{"add": make_tool(add, "t")}] * 2, 2, [0], eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
        model=model, generator=torch.Generator().manual_seed(0), temperature=1.0)
    assert all(r.turns == 2 and r.calls == 1 for r in rows)
    with torch.no_grad():
        lp, _ = completion_logps(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    last = torch.zeros_like(ro.tool_mask)
    for i, r in enumerate(rows):
        last[i, len(forced) + r.mask.count(0):len(r.completion)] = 1  # the second, sampled turn
    assert last.sum() > 0
    torch.testing.assert_close(lp[last.bool()], ro.sampling_logps[last.bool()], atol=1e-4, rtol=1e-4)


def test_the_mismatch_is_logged_per_turn(tok, model):
    """engine_correction's per-turn metric: an engine whose log-probs drift from the trainer's on the
    second turn only (as a re-tokenized history would make them) shows it there and nowhere else."""
    from preftune.algorithms.grpo import GRPOBatch, engine_correction, rollout_logps
    from preftune.distributed.group import Parallel
    from preftune.losses.sampling import turn_index

    eng = Scripted(tok, [[call("add", a=1, b=2), "it is 3"], [call("add", a=2, b=2), "4"]])
    prompt = tok("U:q\nA:", add_special_tokens=False).input_ids
    rows = [Trajectory(list(prompt)) for _ in range(2)]
    ro = loop(tok).run(eng, rows, [{"add": make_tool(add, "t")}] * 2, 2, [0],
                       eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    cfg = GRPOConfig(max_completion_length=200)
    with torch.no_grad():
        trainer = rollout_logps(model, ro, cfg, sampling_distribution=True)  # (2, T)
    drift = 0.25 * (turn_index(ro.tool_mask) == 1)  # (2, T)
    ro.sampling_logps = (trainer + drift) * ro.loss_mask()
    batch = GRPOBatch(rollout=ro, advantages=torch.zeros(2), ref_logps=None)
    _, m = engine_correction(model, batch, cfg, Parallel())
    assert m["sampling/sampling_logp_difference/turn_1"] < 1e-6
    assert m["sampling/sampling_logp_difference/turn_2"] == pytest.approx(0.25, abs=1e-6)
    assert "sampling/sampling_logp_difference/turn_3" not in m


@pytest.mark.parametrize("text, error", [
    ("<tool_call>{not json}</tool_call>", "not JSON"),
    (call("nope", a=1), "unknown tool 'nope'"),
    (call("add", a=1), "wrong arguments for tool 'add'"),
    (call("boom", x=1), "RuntimeError: kaput"),
    (call("slow", x=1), "timed out after 0.2s"),
    ("<tool_call>{\"name\": \"add\"", "without </tool_call>"),
])
def test_every_failing_call_is_the_policy_s_to_read(tok, text, error):
    tools = {f.__name__: make_tool(f, "t") for f in (add, boom, slow)}
    script = [[text, "done"], ["done"]]
    eng = Scripted(tok, script)
    rows = [Trajectory([5, 6]) for _ in range(2)]
    t0 = time.monotonic()
    ro = loop(tok, tool_timeout_seconds=0.2).run(eng, rows, [tools] * 2, 2, [0], eos_id=tok.eos_token_id,
                                                 pad_id=tok.pad_token_id)
    assert time.monotonic() - t0 < 3  # a hung tool never holds the rollout
    assert rows[0].calls == 1 and rows[0].failures == 1 and rows[0].turns == 2
    assert error in rows[0].messages[1]["content"] and "'error'" in rows[0].messages[1]["content"]
    assert ro.tool_mask[0].sum() < ro.completion_mask[0].sum()


def test_async_tools_and_the_iteration_cap(tok):
    tools = {"add_async": make_tool(add_async, "t")}
    eng = Scripted(tok, [[call("add_async", a=1, b=1), call("add_async", a=2, b=2), "x"], ["y"]])
    rows = [Trajectory([5]) for _ in range(2)]
    loop(tok, max_tool_calling_iterations=1).run(eng, rows, [tools] * 2, 2, [0], eos_id=tok.eos_token_id,
                                                 pad_id=tok.pad_token_id)
    assert rows[0].messages[1]["content"] == "2" and rows[0].turns == 2 and rows[0].calls == 1


def test_the_budget_counts_tool_tokens_and_cuts_the_last_turn(tok):
    eng = Scripted(tok, [[call("add", a=1, b=2), "a long final answer"], ["z"]])
    rows = [Trajectory([5]) for _ in range(2)]
    first = len(tok(call("add", a=1, b=2), add_special_tokens=False).input_ids) + 1
    budget = first + 8
    ro = loop(tok, budget=budget).run(eng, rows, [{"add": make_tool(add, "t")}] * 2, 2, [0],
                                      eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    assert len(rows[0].completion) == budget and rows[0].truncated and bool(ro.truncated[0])
    assert int(ro.completion_mask[0].sum()) == budget


def test_parsers():
    assert parse_calls("hi", "hermes") == []
    assert parse_calls(call("add", a=1, b=2) + call("add", a=3, b=4), "hermes") == [Call("add", {"a": 1, "b": 2}),
                                                                                     Call("add", {"a": 3, "b": 4})]
    assert parse_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1}}', "llama3") == [Call("add", {"a": 1})]
    assert parse_calls("plain words", "llama3") == []
    glm = "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>s</arg_key><arg_value>x y</arg_value></tool_call>"
    assert parse_calls(glm, "glm4") == [Call("add", {"a": 1, "s": "x y"})]
    assert parse_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>', "hermes") == \
        [Call("f", {"a": 2})]


def test_a_tool_result_is_cut_to_max_tool_response_length(tok):
    turns = ToolTurns(tok, 3)
    assert turns.suffix([{"role": "tool", "name": "f", "content": "123456"}]) == \
        tok("\nT:123\nA:", add_special_tokens=False).input_ids


def no_doc(a: int) -> int:
    return a


class NoReset:
    def act(self, a: int) -> int:
        """Act.

        Args:
            a: a
        """
        return a


class Raises:
    def __init__(self):
        raise ValueError("no")

    def reset(self, **row):
        return None


class Env:
    def __init__(self):
        self.total = 0

    def reset(self, **row) -> str | None:
        self.total = 0
        return None

    def bump(self, by: int) -> int:
        """Add to the total.

        Args:
            by: how much
        """
        self.total += by
        return self.total

    def get_reward(self) -> float:
        return float(self.total)


@pytest.mark.parametrize("kw, words", [
    ({"tools": [no_doc]}, "tool 'no_doc' has no usable schema"),
    ({"environment_factory": NoReset}, "has no reset method"),
    ({"environment_factory": Raises}, "constructor raised: ValueError: no"),
])
def test_bad_input_stops_at_start(tok, kw, words):
    with pytest.raises(UserError, match=words):
        build_agent(GRPOConfig(), tok, ".", **kw)


def test_a_template_without_tools_stops_at_start():
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(MODEL_DIR)
    with pytest.raises(UserError, match="no tool support"):
        build_agent(GRPOConfig(), plain, ".", tools=[add])


def test_a_template_that_rewrites_history_stops_at_start(tok):
    from transformers import AutoTokenizer

    odd = AutoTokenizer.from_pretrained(MODEL_DIR)
    odd.chat_template = TEMPLATE.replace("A:{{ m['content'] }}", "{% if loop.last %}A:{% else %}B:{% endif %}")
    with pytest.raises(UserError, match="does not keep the conversation"):
        build_agent(GRPOConfig(), odd, ".", tools=[add])


def test_an_environment_per_row_its_tools_and_its_reward(tok):
    agent = build_agent(GRPOConfig(), tok, ".", tools=[add], environment_factory=Env)
    assert [s["function"]["name"] for s in agent.schemas] == ["add", "bump"]
    envs = agent.envs.instances([{}, {}])
    assert envs[0] is not envs[1]
    out, failed = run_call(Call("bump", {"by": 3}), agent.row_tools(envs[0]), 1.0)
    assert (out, failed) == ("3", False) and envs[1].total == 0
    assert agent.envs.reward_func()(environments=envs) == [3.0, 0.0]
    assert isinstance(Environments(Env).classes[0].pool[0], Env)
    assert agent.row_schemas(envs[0]) is None  # one class: every prompt shows the same tools


class Shelf:
    """A second environment: no reward of its own."""

    def reset(self, **row) -> str | None:
        self.items = list(row.get("items", []))
        return None

    def count(self) -> int:
        """How many items are on the shelf."""
        return len(self.items)


def test_a_mapping_of_environments_is_picked_per_row(tok):
    agent = build_agent(GRPOConfig(), tok, ".", environment_factory={"counter": Env, "shelf": Shelf})
    assert [s["function"]["name"] for s in agent.schemas] == ["bump", "count"]
    rows = [{"environment": "shelf", "items": [1, 2]}, {"environment": "counter"},
            {"environment": "shelf"}]
    envs = agent.envs.instances(rows)
    assert [type(e) for e in envs] == [Shelf, Env, Shelf] and envs[0] is not envs[2]
    for e, row in zip(envs, rows):
        agent.reset(e, row)
    # each row's prompt shows its own class's tools, and only those run
    assert [s["function"]["name"] for s in agent.row_schemas(envs[0])] == ["count"]
    assert set(agent.row_tools(envs[1])) == {"bump"}
    assert run_call(Call("count", {}), agent.row_tools(envs[0]), 1.0) == ("2", False)
    assert run_call(Call("count", {}), agent.row_tools(envs[1]), 1.0)[1]  # not this row's tool
    run_call(Call("bump", {"by": 4}), agent.row_tools(envs[1]), 1.0)
    # get_reward where the class has one; None (not applicable) where it has not
    assert agent.envs.reward_func()(environments=envs) == [None, 4.0, None]
    with pytest.raises(UserError, match=r"a row's environment is 'attic', not one of counter, shelf"):
        agent.envs.instances([{"environment": "attic"}])


@pytest.mark.parametrize("extra, key", [
    (["grpo.rollout=offline"], "grpo.tools"),
    (["grpo.use_vllm=true", "grpo.vllm_tensor_parallel_size=2"], "grpo.vllm_tensor_parallel_size"),
    (["grpo.rollout_func=f.py:g"], "grpo.rollout_func"),
])
def test_config_rules_for_tools(make_config, extra, key):
    with pytest.raises(UserError) as e:
        make_config("grpo.tools=[tools.py:add]", *extra)
    assert e.value.where == key


def test_an_environment_may_be_the_only_reward_source(make_config):
    cfg = make_config("grpo.environment_factory=env.py:Env", "grpo.reward_funcs=[]")
    assert cfg.grpo.reward_funcs == [] and cfg.grpo.environment_factory == "env.py:Env"
