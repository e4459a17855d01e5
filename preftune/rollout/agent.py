"""The multi-turn tool loop on top of a rollout engine (`rollout/engine.py`), token-in/token-out.

Each row (one completion of one prompt) alternates: the engine samples an assistant turn; the
calls written in it are run (`rollout/tools.py`); their results, rendered once as the chat
template's tool-turn suffix (`ToolTurns`), are appended as token ids; the engine samples again
from prompt ids + everything so far. The conversation is never re-tokenized, so the training
pass sees exactly the sampled tokens. The tool tokens carry 0 in `Rollout.tool_mask`, so they
are left out of the loss, the KL, the entropy and every normaliser; each turn's stop token is
sampled, so it stays in. The completion budget (grpo.max_completion_length) counts every token
of the completion, tool tokens included (TRL's rule).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from preftune.data.messages import is_messages
from preftune.data.tensors import left_pad
from preftune.errors import UserError, one_line
from preftune.rewards.functions import load_callable
from preftune.rollout.sampler import Rollout
from preftune.rollout.tools import Environments, Tool, make_tool, parse_calls, pick_format, run_call


@dataclass
class Trajectory:
    """One row's conversation as token ids; `mask` 1 for sampled tokens, 0 for tool tokens."""

    prompt: list[int]
    completion: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    # assistant and tool turns (rewards, the dump)
    messages: list[dict] = field(default_factory=list)
    turns: int = 0
    calls: int = 0
    failures: int = 0
    truncated: bool = False  # the last turn ended without its stop token

    def add(self, ids: list[int], logps: list[float], sampled: bool) -> None:
        self.completion += ids
        self.mask += [int(sampled)] * len(ids)
        self.logps += logps if sampled else [0.0] * len(ids)


class ToolTurns:
    """A list of tool messages as the token ids the template puts after an assistant turn's stop
    token, through the next assistant header: the conversation rendered with and without them,
    the difference taken (the prefix is checked, so a template that rewrites history stops)."""

    def __init__(self, tokenizer, max_response_tokens: int | None):
        self.tok, self.cap = tokenizer, max_response_tokens
        # fails now, not mid-run
        self.suffix([{"role": "tool", "name": "probe", "content": "probe"}])

    def suffix(self, messages: list[dict]) -> list[int]:
        tok = self.tok
        if self.cap is not None:  # the result is cut to its first tokens, then rendered
            messages = [m | {"content": tok.decode(tok(m["content"],
                                                       add_special_tokens=False).input_ids[:self.cap])}
                        for m in messages]
        call = {"type": "function", "function": {"name": messages[0]["name"], "arguments": {}}}
        head = [{"role": "user", "content": "u"},
                {"role": "assistant", "content": "", "tool_calls": [call]}]
        before = self._ids(head, generation=False)
        eos = [i for i, t in enumerate(before) if t == tok.eos_token_id]
        # the sampled turn ends at its stop token; what the template adds after it is the suffix's
        if eos:
            before = before[:eos[-1] + 1]
        after = self._ids(head + messages, generation=True)
        if after[:len(before)] != before:
            raise UserError("the chat template does not keep the conversation before a tool turn "
                            "as it was (rendering a tool message changes earlier tokens); tool "
                            "turns cannot be appended as token ids", where="model.chat_template")
        return after[len(before):]

    def _ids(self, messages, generation: bool) -> list[int]:
        text = self.tok.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=generation)
        return self.tok(text, add_special_tokens=False).input_ids


class ToolLoop:
    """Runs rows through their turns on an engine -> (Rollout with tool_mask, trajectories)."""

    def __init__(self, tokenizer, cfg, fmt: str, turns: ToolTurns):
        self.tok, self.cfg, self.fmt, self.turns = tokenizer, cfg, fmt, turns

    def run(self, engine, rows: list[Trajectory], tools: list[dict[str, Tool]],
            G: int, positions: list[int], **kw) -> Rollout:
        """rows: N = B * G trajectories (group-contiguous) holding their prompts; positions: each
        prompt's place in the draw. `kw`: the engine's sampling options (eos_id, pad_id, ...)."""
        with engine.conversation():  # later turns continue from the engine's cached prefixes
            self._turns(engine, rows, tools, G, positions, kw)
        return assemble(rows, kw["pad_id"], with_logps=engine.with_logps)

    def _turns(self, engine, rows, tools, G: int, positions: list[int], kw: dict) -> None:
        budget, firsts = self.cfg.max_completion_length, [t.prompt for t in rows]
        # each row's place (vLLM seeds)
        at = [positions[i // G] * G + i % G for i in range(len(rows))]
        # a group shares its prompt
        if all(firsts[i] == firsts[i - i % G] for i in range(len(rows))):
            ro = engine.generate(firsts[::G], positions, num_generations=G,
                                 max_new_tokens=budget, **kw)
        else:  # an environment's reset text made the group's prompts differ
            ro = engine.generate(firsts, at, num_generations=1, max_new_tokens=budget, turn=1, **kw)
        active, turn = list(range(len(rows))), 0
        while True:
            self._take(ro, [rows[i] for i in active], budget)
            active = [i for i in active if self._act(rows[i], tools[i], turn)]
            if not active:
                break
            turn += 1
            room = max(budget - len(rows[i].completion) for i in active)
            ro = engine.generate([rows[i].prompt + rows[i].completion for i in active],
                                 [at[i] for i in active],
                                 num_generations=1, max_new_tokens=room, turn=turn + 1, **kw)

    def _take(self, ro: Rollout, rows: list[Trajectory], budget: int) -> None:
        """Each row's sampled turn (up to and including its stop token), cut to the budget left."""
        lengths = ro.completion_mask.sum(-1).tolist()
        ids, trunc = ro.completion_ids.cpu().tolist(), ro.truncated.tolist()
        lps = ro.sampling_logps.cpu().tolist() if ro.sampling_logps is not None else None
        for j, t in enumerate(rows):
            n = min(int(lengths[j]), budget - len(t.completion))
            t.add(ids[j][:n], lps[j][:n] if lps is not None else [0.0] * n, sampled=True)
            t.turns += 1
            t.truncated = bool(trunc[j]) or n < lengths[j]
            t.messages.append({"role": "assistant", "content": self._text(ids[j][:n], t.truncated)})

    def _text(self, ids: list[int], truncated: bool) -> str:
        # without the stop token
        return self.tok.decode(ids if truncated else ids[:-1], skip_special_tokens=False)

    def _act(self, t: Trajectory, tools: dict[str, Tool], turn: int) -> bool:
        """Run the calls of the row's last turn and append their results -> whether it samples
        again."""
        cap = self.cfg.max_tool_calling_iterations
        if t.truncated or (cap is not None and turn >= cap):
            return False
        calls = parse_calls(t.messages[-1]["content"], self.fmt)
        if not calls:
            return False
        # as TRL's completions show them (rewards, the dump); a malformed call has no name
        t.messages[-1]["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls if c.name is not None and c.error is None]
        results = []
        for call in calls:
            content, failed = run_call(call, tools, self.cfg.tool_timeout_seconds)
            t.calls, t.failures = t.calls + 1, t.failures + int(failed)
            results.append({"role": "tool", "name": call.name or "unknown", "content": content})
        suffix = self.turns.suffix(results)
        # no room to answer: stop here
        if len(t.completion) + len(suffix) >= self.cfg.max_completion_length:
            return False
        t.add(suffix, [], sampled=False)
        t.messages += results
        return True


def assemble(rows: list[Trajectory], pad_id: int, *, with_logps: bool) -> Rollout:
    """Trajectories as a Rollout: prompts left-padded, completions right-padded, `tool_mask` 0 on
    tool tokens; `sampling_logps` the engine's (0 on tool tokens) when it gives them."""
    p_ids, p_mask = left_pad([t.prompt for t in rows], pad_id)  # (N, P)
    N, T = len(rows), max([len(t.completion) for t in rows] + [1])
    ids = torch.full((N, T), pad_id, dtype=torch.long)  # (N, T)
    # (N, T)
    cmask, tmask = torch.zeros(N, T, dtype=torch.long), torch.zeros(N, T, dtype=torch.long)
    logps = torch.zeros(N, T)  # (N, T)
    for i, t in enumerate(rows):
        n = len(t.completion)
        ids[i, :n] = torch.tensor(t.completion, dtype=torch.long)
        cmask[i, :n] = 1
        tmask[i, :n] = torch.tensor(t.mask, dtype=torch.long)
        logps[i, :n] = torch.tensor(t.logps)
    return Rollout(prompt_ids=p_ids, prompt_mask=p_mask, completion_ids=ids, completion_mask=cmask,
                   truncated=torch.tensor([t.truncated for t in rows], dtype=torch.bool),
                   sampling_logps=logps if with_logps else None, tool_mask=tmask)


def completions_of(rows: list[Trajectory], prompts: list, tokenizer) -> list:
    """What reward functions receive: for chat prompts the turns as messages (TRL's form), else the
    completion's text (tool results included)."""
    return [t.messages if is_messages(p) else tokenizer.decode(t.completion,
                                                               skip_special_tokens=True)
            for t, p in zip(rows, prompts)]


def stats(rows: list[Trajectory]) -> list[float]:
    """Sums for the metrics, added over rounds and ranks: rows, turns, calls, failures, tool tokens,
    tokens."""
    return [float(len(rows)), float(sum(t.turns for t in rows)), float(sum(t.calls for t in rows)),
            float(sum(t.failures for t in rows)),
            float(sum(len(t.mask) - sum(t.mask) for t in rows)),
            float(sum(len(t.mask) for t in rows))]


def tool_metrics(rows: float, turns: float, calls: float, failures: float, tool_tokens: float,
                 tokens: float) -> dict:
    """TRL's names (`tools/call_frequency`: calls per completion; `tools/failure_frequency`: failed
    calls per call) and turns per completion, the share of tool tokens among completion tokens."""
    return {"tools/call_frequency": calls / max(rows, 1.0),
            "tools/failure_frequency": failures / calls if calls else 0.0,
            "tools/turns": turns / max(rows, 1.0),
            "tools/token_share": tool_tokens / max(tokens, 1.0)}


@dataclass
class Agent:
    """What a run's rollouts act with: the loop, the plain tools, the environments (or None)."""

    loop: ToolLoop
    tools: list[Tool]
    envs: Environments | None

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools] + (self.envs.schemas if self.envs is not None else [])

    def row_schemas(self, env) -> list[dict] | None:
        """The tools a row's prompt shows when they differ from `schemas` (an environment mapping:
        the plain tools and the row's class's), else None."""
        if env is None or self.envs.by_name is None:
            return None
        return [t.schema for t in self.tools] + self.envs.of(env).schemas

    def row_tools(self, env) -> dict[str, Tool]:
        own = {t.name: t for t in self.tools}
        return own | self.envs.tools(env) if env is not None else own

    def reset(self, env, row: dict) -> str | None:
        try:
            out = env.reset(**row)
        except Exception as e:  # noqa: BLE001 - the user's reset
            c = self.envs.of(env)
            raise UserError(f"{c.name}.reset raised: {one_line(e, with_type=True)}",
                            where=c.where) from None
        return out if isinstance(out, str) else None


def build_agent(cfg, tokenizer, base_dir, tools=(), environment_factory=None) -> Agent | None:
    """The run's agent from grpo.tools / grpo.environment_factory (`tools`, `environment_factory`:
    objects already loaded, e.g. in tests), checked now: schemas, `reset`, the template's format
    and its prefix rule. None when the run has neither."""
    funcs = list(tools) + [load_callable(s, base_dir, "grpo.tools") for s in cfg.tools]
    factory, where = environment_factory, "grpo.environment_factory"
    if factory is None and isinstance(cfg.environment_factory, dict):  # a class per row's name
        factory = {name: load_callable(spec, base_dir, f"{where}.{name}")
                   for name, spec in cfg.environment_factory.items()}
    elif factory is None and cfg.environment_factory:
        factory = load_callable(cfg.environment_factory, base_dir, where)
    if not funcs and factory is None:
        return None
    made = [make_tool(f, "grpo.tools") for f in funcs]
    envs = Environments(factory) if factory is not None else None
    fmt = pick_format(tokenizer, cfg.tool_call_format)
    return Agent(ToolLoop(tokenizer, cfg, fmt,
                          ToolTurns(tokenizer, cfg.max_tool_response_length)), made, envs)


def dump_trajectories(path, step: int, scored, tokenizer, limit: int) -> None:
    """The first `limit` trajectories of a generation batch as JSON lines (appended): the turns, the
    calls and results, the reward, and which completion tokens trained (`trained`: 1 sampled, 0
    tool)."""
    with open(path, "a", encoding="utf-8") as f:
        for i, t in enumerate(scored.trajectories[:limit]):
            f.write(json.dumps({"step": step, "row": i, "prompt": tokenizer.decode(t.prompt),
                                "messages": t.messages,
                                "reward": float(scored.total[i]), "turns": t.turns,
                                "calls": t.calls, "failures": t.failures, "truncated": t.truncated,
                                "completion_ids": t.completion, "trained": t.mask}) + "\n")
