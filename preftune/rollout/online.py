"""Online generation batches: sample G completions per prompt from the policy and score them."""
from __future__ import annotations

import dataclasses

import torch

from preftune.config import GRPOConfig
from preftune.data.messages import is_messages
from preftune.data.stream import IndexStream
from preftune.data.tokenize import PromptTruncation, encode_prompt
from preftune.distributed.group import Parallel
from preftune.errors import UserError
from preftune.losses.advantages import group_spread
from preftune.rewards.functions import RewardLog, RewardState, as_completions, compute_rewards
from preftune.rollout.agent import Agent, Trajectory, completions_of, stats, tool_metrics
from preftune.rollout.custom import RolloutContext, run_rollout_func
from preftune.rollout.engine import SamplerEngine
from preftune.rollout.sampler import Rollout, concat, select
from preftune.rollout.scored import Scored


def _with_appended(prompt: list, text: str) -> list:
    """A chat prompt with `text` appended to its last user message (an environment's reset)."""
    out = [dict(m) for m in prompt]
    last = max((i for i, m in enumerate(out) if m.get("role") == "user"), default=len(out) - 1)
    out[last]["content"] = f"{out[last].get('content') or ''}{text}"
    return out


def act(agent: Agent, engine, tokenizer, reward_funcs, weights, state, prompts: list,
        columns: dict, ids: list,
        places: list[int], *, num_generations: int, max_prompt_length: int, **opts) -> Scored:
    """Multi-turn rollouts of prompts (`rollout/agent.py`), scored: an environment per row, reset
    with its row (a returned string appended to the last user message); tools run between turns;
    the rewards see the turns and the environments. Training's rounds and evaluation share it."""
    G, n = num_generations, len(prompts) * num_generations
    data = [{"prompt": prompts[i // G]} | {k: v[i // G] for k, v in columns.items()}
            for i in range(n)]
    envs = agent.envs.instances(data) if agent.envs is not None else [None] * n
    rows = []
    for i, env in enumerate(envs):
        prompt, first = prompts[i // G], ids[i // G]
        text = None if env is None else agent.reset(env, data[i])
        schemas = agent.row_schemas(env)
        # then encoded again, kept to the prompt limit from the left
        if (text is not None or schemas is not None) and is_messages(prompt):
            first = encode_prompt(tokenizer, _with_appended(prompt, text or ""),
                                  schemas or agent.schemas)[-max_prompt_length:]
        rows.append(Trajectory(first))
    ro = agent.loop.run(engine, rows, [agent.row_tools(e) for e in envs], G, places, **opts)
    rep_prompts, rep_cols = (
        [p for p in prompts for _ in range(G)],
        {k: [x for x in v for _ in range(G)] for k, v in columns.items()},
    )
    res = compute_rewards(reward_funcs, rep_prompts, completions_of(rows, rep_prompts, tokenizer),
                          [t.completion for t in rows], rep_cols,
                          weights=weights, extra_kwargs={"trainer_state": state} | (
                              {"environments": envs} if agent.envs is not None else {}))
    return Scored(ro, res.per_func, res.total, list(res.names),
                  [G] * len(prompts), trajectories=rows)


def completion_texts(tokenizer, rollout: Rollout, prompts: list) -> tuple[list, list[list[int]]]:
    """Decoded completions (chat form for chat prompts, as TRL passes them) and their ids up to
    EOS."""
    # the mask is a prefix: one copy, no per-row sync
    lengths = rollout.completion_mask.sum(-1).tolist()
    ids = [row[:n] for row, n in zip(rollout.completion_ids.cpu().tolist(), lengths)]
    return as_completions(prompts, tokenizer.batch_decode(ids, skip_special_tokens=True)), ids


def encode_prompts(tokenizer, prompt_set, indices: list[int], truncation: PromptTruncation, *,
                   kept: list | None = None, tools: list[dict] | None = None):
    """Tokenise prompts[indices]; prompts the truncation policy drops, and prompts of no token at
    all (nothing to sample from), are left out (and counted there). `kept` receives the positions in
    `indices` of the prompts kept; `tools`: the JSON schemas a chat prompt is rendered with."""
    prompts, columns = prompt_set.select(indices)
    keep, ids = [], []
    for j, (i, p) in enumerate(zip(indices, prompts)):
        enc = encode_prompt(tokenizer, p, tools)
        if not enc:
            truncation.drop_empty(f"prompt {i}")
            continue
        enc = truncation.apply(enc, where=f"prompt {i}")
        if enc is not None:
            keep.append(j)
            ids.append(enc)
    prompts = [prompts[j] for j in keep]
    columns = {k: [v[j] for j in keep] for k, v in columns.items()}
    if kept is not None:
        kept.extend(keep)
    return prompts, columns, ids


def score(tokenizer, reward_funcs, ro: Rollout, prompts: list, columns: dict, G: int,
          weights, state) -> Scored:
    rep_prompts = [p for p in prompts for _ in range(G)]
    rep_cols = {k: [x for x in v for _ in range(G)] for k, v in columns.items()}
    completions, comp_ids = completion_texts(tokenizer, ro, rep_prompts)
    res = compute_rewards(reward_funcs, rep_prompts, completions, comp_ids,
                          rep_cols, weights=weights, extra_kwargs={"trainer_state": state})
    return Scored(ro, res.per_func, res.total, list(res.names), [G] * len(prompts), log=res.log)


def empty_scored(n_funcs: int, with_logps: bool = False) -> Scored:
    """A round with no prompts (zero rows), so every rank takes part in every round."""
    z = torch.zeros((0, 1), dtype=torch.long)
    ro = Rollout(prompt_ids=z, prompt_mask=z, completion_ids=z, completion_mask=z,
                 truncated=torch.zeros(0, dtype=torch.bool),
                 sampling_logps=torch.zeros(0, 1) if with_logps else None)
    return Scored(ro, torch.zeros((0, n_funcs)), torch.zeros(0), [], [])


class OnlineSource:
    def __init__(self, cfg: GRPOConfig, tokenizer, prompt_set, reward_funcs, *,
                 seed: int, shuffle: bool,
                 truncation: PromptTruncation, device: torch.device, dp: Parallel, engine=None,
                 agent: Agent | None = None, rollout_func=None):
        self.cfg, self.tok, self.prompt_set, self.reward_funcs = (
            cfg,
            tokenizer,
            prompt_set,
            list(reward_funcs),
        )
        self.weights, self.agent, self.tool_sums = cfg.reward_weights, agent, [0.0] * 6
        self.rollout_func = rollout_func  # TRL's contract (`rollout/custom.py`)
        if agent is not None and agent.envs is not None and agent.envs.has_reward:  # TRL: weight 1
            self.reward_funcs.append(agent.envs.reward_func())
            self.weights = None if self.weights is None else [*self.weights, 1.0]
        if not self.reward_funcs:
            raise UserError("no reward source: list reward functions, "
                            "or give the environment a get_reward method",
                            where="grpo.reward_funcs")
        self.engine = engine if engine is not None else SamplerEngine()  # `rollout/engine.py`
        self.seed, self.step, self.rounds = seed, 0, 0
        # ranks draw the same global order and sample their own share of it
        self.dp = dp
        self.stream = IndexStream(len(prompt_set), seed, shuffle)
        self.truncation = truncation
        self.generator = torch.Generator(device=device).manual_seed(seed + 1_000_003 * self.dp.rank)
        self.state = RewardState()

    def _draw(self, n_prompts: int):
        """Prompts for one round (this rank's share of n_prompts), with each one's place in the
        round's draw, and the partners' prompts (ids, places) before and after them when a
        tensor-parallel engine samples the group's shares together. When
        data.prompt_truncation=drop leaves none on any rank, draw again: 2 * len consecutive draws
        cover a whole epoch, so after that no prompt fits and the run cannot go on."""
        drawn, tp = 0, self.engine.tp
        while drawn < 2 * len(self.prompt_set):
            order, mine = self.stream.take(n_prompts), self.dp.balanced_share(n_prompts)
            prompts, columns, ids, places = self._encode(order, mine, self.truncation)
            partners = ([], [], [], [])
            if tp > 1:  # the partners' prompts, counted where they are the partner's own
                group, scratch = (
                    self.dp.engine_group_share(n_prompts, tp),
                    dataclasses.replace(self.truncation, seen=set()),
                )
                before = self._encode(order, slice(group.start, mine.start), scratch)
                after = self._encode(order, slice(mine.stop, group.stop), scratch)
                partners = (before[2], before[3], after[2], after[3])
            self.rounds += 1
            if self.dp.sum(len(ids))[0]:
                return prompts, columns, ids, places, partners
            drawn += n_prompts
        raise UserError("every prompt is longer than "
                        f"data.max_prompt_length={self.truncation.max_length} and "
                        "data.prompt_truncation=drop", where="data.max_prompt_length")

    def _encode(self, order: list[int], part: slice, truncation: PromptTruncation):
        kept = []
        prompts, columns, ids = encode_prompts(
            self.tok,
            self.prompt_set,
            order[part],
            truncation,
            kept=kept,
            tools=self.agent.schemas if self.agent is not None else None,
        )
        return prompts, columns, ids, [part.start + j for j in kept]

    def _round(self, model, n_prompts: int) -> Scored:
        prompts, columns, ids, places, (ids_before, at_before, ids_after,
                                        at_after) = self._draw(n_prompts)
        c, empty = self.cfg, empty_scored(len(self.reward_funcs), with_logps=self.engine.with_logps)
        opts = dict(num_generations=c.num_generations, max_new_tokens=c.max_completion_length,
                    eos_id=self.tok.eos_token_id, pad_id=self.tok.pad_token_id,
                    temperature=c.temperature, top_p=c.top_p, top_k=c.top_k)
        if self.agent is not None and ids:
            return self._act(model, prompts, columns, ids, places, opts)
        if self.rollout_func is not None and ids:
            return self._custom(model, prompts, columns, opts)
        # the partners of a tensor-parallel engine send the same requests
        every = ids_before + ids + ids_after
        if not every:
            return empty
        ro = self.engine.generate(every, at_before + places + at_after,
                                  seed=self.seed, step=self.step,
                                  round_=self.rounds, generator=self.generator, model=model, **opts)
        if ids_before or ids_after:  # keep this rank's rows
            G = c.num_generations
            ro = select(ro, list(range(len(ids_before) * G, (len(ids_before) + len(ids)) * G)))
        # a resampling round smaller than the world size leaves some ranks nothing to do
        if not ids:
            return empty
        return score(self.tok, self.reward_funcs, ro, prompts, columns, c.num_generations,
                     self.weights, self.state)

    def _act(self, model, prompts: list, columns: dict, ids: list,
             places: list[int], opts: dict) -> Scored:
        """A round of multi-turn rollouts (`act`), its tool counts kept for the batch's metrics."""
        opts = {k: v for k, v in opts.items() if k != "max_new_tokens"}
        out = act(self.agent, self.engine, self.tok, self.reward_funcs, self.weights,
                  self.state, prompts, columns,
                  ids, places, max_prompt_length=self.truncation.max_length, model=model,
                  generator=self.generator,
                  seed=self.seed, step=self.step, round_=self.rounds, **opts)
        self.tool_sums = [a + b for a, b in zip(self.tool_sums, stats(out.trajectories))]
        return out

    def _custom(self, model, prompts: list, columns: dict, opts: dict) -> Scored:
        """A round sampled by the user's rollout_func; its extra fields go to the reward
        functions."""
        G = self.cfg.num_generations
        ctx = RolloutContext(
            self.cfg,
            self.tok,
            G,
            self.state,
            self.engine,
            model,
            {k: v for k, v in opts.items() if k not in ("num_generations", "max_new_tokens")}
            | {
                "generator": self.generator,
                "seed": self.seed,
                "step": self.step,
                "round_": self.rounds,
            },
        )
        ro, extra = run_rollout_func(self.rollout_func, prompts, ctx,
                                     self.tok.eos_token_id, self.tok.pad_token_id)
        rep_prompts = [p for p in prompts for _ in range(G)]
        completions, comp_ids = completion_texts(self.tok, ro, rep_prompts)
        cols = {k: [x for x in v for _ in range(G)] for k, v in columns.items()} | extra
        res = compute_rewards(self.reward_funcs, rep_prompts, completions, comp_ids,
                              cols, weights=self.weights,
                              extra_kwargs={"trainer_state": self.state})
        return Scored(ro, res.per_func, res.total, list(res.names), [G] * len(prompts))

    def make_batch(self, model, step: int) -> Scored:
        """One generation batch. With dynamic sampling (DAPO), groups whose rewards are all equal
        are dropped and new prompts sampled until the batch is full or `max_resample_rounds` is
        spent."""
        # TRL's trainer_state.global_step counts the optimiser steps done: 0 while step 1 is built
        self.state.global_step, self.step, self.rounds, self.tool_sums = (
            step - 1,
            step,
            0,
            [0.0] * 6,
        )
        G, want = self.cfg.num_generations, self.cfg.prompts_per_step
        kept: list[Scored] = []
        n_groups, rounds, dropped, last = 0, 0, 0, None  # n_groups, dropped: over all ranks
        # every round's calls, dropped groups' included: the functions ran on them
        logged = RewardLog()
        while n_groups < want:
            s = self._round(model, want - n_groups)
            last, rounds = s, rounds + 1  # rounds: generation rounds done (1 = no resampling)
            logged.add(s.log)
            if self.cfg.dynamic_sampling:
                spread = group_spread(s.total, s.group_sizes) > 0  # (b,)
                dropped += int(self.dp.sum(int((~spread).sum()))[0])
                rows = torch.nonzero(spread.repeat_interleave(G)).squeeze(-1)
                s = Scored(select(s.rollout, rows), s.per_func[rows], s.total[rows], s.names,
                           [G] * int(spread.sum()),
                           trajectories=[s.trajectories[i] for i in rows.tolist()
                                         if s.trajectories])
            if s.group_sizes:
                kept.append(s)
            n_groups += int(self.dp.sum(len(s.group_sizes))[0])
            if not self.cfg.dynamic_sampling or rounds > self.cfg.max_resample_rounds:
                break
        if not n_groups:
            kept = [last]  # every group was flat: train on the last round (all advantages are 0)
        mine = sum(len(k.group_sizes) for k in kept)
        # the global batch is the first `want` groups in rank order
        before, _ = self.dp.row_offset(mine)
        n = max(0, min(mine, want - before)) * G if n_groups else mine * G
        kept = kept or [last]
        ro = select(concat([k.rollout for k in kept], self.tok.pad_token_id), list(range(n)))
        names = next((k.names for k in kept if k.names), last.names)
        out = Scored(ro, torch.cat([k.per_func for k in kept])[:n],
                     torch.cat([k.total for k in kept])[:n], names, [G] * (n // G), log=logged)
        if self.cfg.dynamic_sampling:
            out.extra = {"dynamic_sampling/rounds": rounds,
                         "dynamic_sampling/dropped_groups": dropped}
        if self.agent is not None:  # every round's and every rank's rows
            out.extra = out.extra | tool_metrics(*self.dp.sum(*self.tool_sums))
            out.trajectories = [t for k in kept for t in k.trajectories][:n]
        return out

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
        self.generator.set_state(state["generator"])
