"""Agent traces offline, per algorithm: SFT trains every assistant turn, DPO/KTO leave a tool's
output out of their log-prob sums, offline GRPO out of its loss; a short SFT run on the embedded
agent traces learns."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from preftune.algorithms.dpo import EncodedPair, sequence_logps
from preftune.algorithms.grpo import GRPOTask, grpo_step, new_batch
from preftune.algorithms.kto import summed_logps
from preftune.algorithms.sft import SFTTask
from preftune.config import load_config
from preftune.data.turns import encode_row
from preftune.model.logps import list_logps
from preftune.distributed.group import Parallel
from tests.conftest import EXAMPLES, flat_grads, write_jsonl

AGENT_MODEL = EXAMPLES / "agent_model"
AGENT_TRACES = EXAMPLES / "data" / "agent_traces.parquet"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def agent_tok():
    from preftune.model.load import load_tokenizer

    return load_tokenizer(str(AGENT_MODEL))


@pytest.fixture
def agent_model():
    from preftune.config import ModelConfig
    from preftune.model.load import load_model

    return load_model(ModelConfig(), str(AGENT_MODEL))


def agent_config(tmp_path, *overrides: str):
    return load_config(None, [f"output_dir={tmp_path / 'run'}", f"model.name_or_path={AGENT_MODEL}",
                              f"data.train={AGENT_TRACES}", "max_steps=2", "save_steps=0", "log.progress_bar=false",
                              "data.max_prompt_length=128", "optim.lr=1e-3", *overrides])


def encoded_rows(tok, n: int = 6):
    """The first n multi-turn agent traces encoded (prompt, completion, mask)."""
    import pyarrow.parquet as pq

    from preftune.data.traces import normalize_messages

    out = []
    for row in pq.read_table(AGENT_TRACES).to_pylist():
        response = normalize_messages(row["output"])
        if len(response) > 1:
            e = encode_row(tok, normalize_messages(row["input"]), response, tools=json.loads(row["tools"]))
            out.append((e.prompt, e.completion, e.mask))
        if len(out) == n:
            return out
    raise AssertionError("too few multi-turn traces")


def per_token(model, rows):
    """Unmasked per-token log-probs (n, T) and the masks as a (n, T) tensor."""
    with torch.no_grad():
        lp, _, pad = list_logps(model, [r[0] for r in rows], [r[1] for r in rows], 0, CPU)
    mask = torch.zeros_like(pad)
    for i, r in enumerate(rows):
        mask[i, :len(r[2])] = torch.tensor(r[2])
    return lp, mask


def test_dpo_sums_leave_the_tool_tokens_out(agent_model, agent_tok):
    rows = encoded_rows(agent_tok)
    pairs = [EncodedPair(rows[i][0], rows[i][1], rows[i + 1][1], rows[i][2], rows[i + 1][2]) for i in (0, 2, 4)]
    lp, mask = per_token(agent_model, [(p.prompt, c, m) for p in pairs
                                       for c, m in ((p.chosen, p.chosen_mask), (p.rejected, p.rejected_mask))])
    with torch.no_grad():
        sums, lengths = sequence_logps(agent_model, pairs, 0, CPU)  # (6,): the chosen, then the rejected
    order = [0, 2, 4, 1, 3, 5]
    torch.testing.assert_close(sums, (lp * mask).sum(1)[order], rtol=1e-6, atol=1e-5)
    assert torch.equal(lengths, mask.sum(1)[order])
    assert (mask.sum(1) < torch.tensor([len(c) for p in pairs for c in (p.chosen, p.rejected)])).all()


def test_kto_sums_leave_the_tool_tokens_out(agent_model, agent_tok):
    rows = encoded_rows(agent_tok)
    lp, mask = per_token(agent_model, rows)
    with torch.no_grad():
        got = summed_logps(agent_model, rows, 0, CPU)
        unmasked = summed_logps(agent_model, [r[:2] for r in rows], 0, CPU)
    torch.testing.assert_close(got, (lp * mask).sum(1), rtol=1e-6, atol=1e-5)
    assert (got != unmasked).all()


def test_sft_trains_every_assistant_turn_of_a_messages_row(tmp_path, agent_tok, agent_model):
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
    conv = [{"role": "user", "content": "1+2="}, call, {"role": "tool", "content": "3"},
            {"role": "assistant", "content": "3"}, {"role": "user", "content": "again"},
            {"role": "assistant", "content": "3"}]
    tools = json.dumps([{"type": "function", "function": {"name": "add"}}])
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": conv, "tools": tools}])
    task = SFTTask(agent_config(tmp_path, f"data.train={path}", "sft.max_length=256"), agent_model, agent_tok, CPU, dp=Parallel())
    (ex,) = task.encoded
    want = encode_row(agent_tok, conv[:1], conv[1:], tools=json.loads(tools))
    assert ex.prompt == want.prompt and ex.completion == want.completion and ex.mask == want.mask
    eos = agent_tok.eos_token_id
    assert [m for t, m in zip(ex.completion, ex.mask) if t == eos] == [1, 0, 1, 0, 1]  # 3 assistant turns' stops
    full = SFTTask(agent_config(tmp_path, f"data.train={path}", "sft.max_length=256", "sft.assistant_only_loss=false"),
                   agent_model, agent_tok, CPU, dp=Parallel())
    assert full.encoded[0].mask is None and full.encoded[0].trained == len(ex.completion) > ex.trained


def test_offline_grpo_leaves_tool_tokens_out_of_the_loss(tmp_path, agent_tok, agent_model):
    cfg = agent_config(tmp_path, "algorithm=grpo", "grpo.rollout=offline", "grpo.prompts_per_step=3",
                       "grpo.max_completion_length=128", "grpo.beta=0.1", "grpo.micro_batch_size=64")
    task = GRPOTask(cfg, agent_model, agent_tok, CPU, dp=Parallel())
    s = task.source.make_batch(agent_model, 1)
    ro = s.rollout
    assert ro.tool_mask is not None and ((ro.tool_mask == 0) & (ro.completion_mask == 1)).any()
    assert (ro.tool_mask[ro.completion_mask == 0] == 1).all()  # padding is left to the completion mask
    batch = new_batch(s, agent_model, copy.deepcopy(agent_model), cfg.grpo, dp=Parallel())  # a reference: beta > 0

    def grads(b):
        agent_model.zero_grad()
        grpo_step(agent_model, b, cfg.grpo, dp=Parallel())
        return flat_grads(agent_model).clone()

    ro = batch.rollout
    tool_tokens = (ro.tool_mask == 0) & (ro.completion_mask == 1)
    with_mask = grads(batch)
    scale = with_mask.abs().max().item()
    batch.ref_logps = batch.ref_logps.masked_fill(tool_tokens, -3.0)  # a tool token's KL term, if it counted
    # (CPU gradients of two identical steps differ by ~1e-9 here: threads reduce in varying order)
    torch.testing.assert_close(grads(batch), with_mask, rtol=0, atol=1e-6 * scale)
    ro.tool_mask = torch.ones_like(ro.tool_mask)
    ones = grads(batch)
    ro.tool_mask = None
    torch.testing.assert_close(grads(batch), ones, rtol=0, atol=1e-6 * scale)
    assert (ones - with_mask).abs().max() > 0.01 * scale  # the tool tokens' terms, once they count


def test_a_short_sft_run_on_the_agent_traces_learns(tmp_path):
    import preftune

    result = preftune.train(
        agent_config(tmp_path, "algorithm=sft", "max_steps=12", "sft.min_reward=1.0", "sft.batch_size=16",
                     "sft.micro_batch_size=16", "sft.max_length=200", "optim.lr_scheduler=constant", "seed=0"))
    losses = [json.loads(x)["loss"] for x in result.metrics_path.read_text().splitlines() if '"loss"' in x]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3
    report = json.loads((result.output_dir / "data_report.json").read_text())
    assert report["sft"]["examples"] == report["encoded"]["examples"] > 100


def test_a_pairs_file_keeps_the_tools_and_the_masks(tmp_path, agent_tok, agent_model):
    from preftune.algorithms.dpo import DPOTask
    from preftune.data.pairs import write_pairs
    from preftune.data.pipeline import load_pairs

    cfg = agent_config(tmp_path, "algorithm=dpo", "dpo.max_length=256")
    pairs, _ = load_pairs(cfg)
    write_pairs(pairs, str(tmp_path / "pairs.parquet"))
    from_traces = DPOTask(cfg, agent_model, agent_tok, CPU, dp=Parallel()).encoded
    from_file = DPOTask(agent_config(tmp_path, "algorithm=dpo", "dpo.max_length=256",
                                     f"data.train={tmp_path / 'pairs.parquet'}"), agent_model, agent_tok, CPU, dp=Parallel()).encoded
    assert from_file == from_traces and any(e.chosen_mask is not None and 0 in e.chosen_mask for e in from_file)


def test_tools_with_a_template_without_tool_support_stop_at_start(tmp_path):
    import preftune
    from preftune.errors import UserError
    from tests.conftest import MODEL_DIR

    with pytest.raises(UserError, match=rf"^{MODEL_DIR}: the rows have tools .* no tool support"):
        preftune.train(agent_config(tmp_path, "algorithm=sft", f"model.name_or_path={MODEL_DIR}"))


def test_an_sft_run_with_tools_is_evaluated_through_them(tmp_path, agent_tok, agent_model,
                                                         monkeypatch):
    """grpo.tools in an SFT config: the held-out pass runs the tool loop (an agent is evaluated as
    it will act), not a single completion."""
    import preftune.evaluation.evaluate as ev

    (tmp_path / "tools.py").write_text((EXAMPLES / "agent_tools.py").read_text())
    cfg = agent_config(tmp_path, "algorithm=sft", f"grpo.tools=[{tmp_path / 'tools.py'}:add]",
                       f"data.eval={EXAMPLES / 'data' / 'agent_eval_prompts.jsonl'}",
                       "grpo.max_completion_length=8", "eval.batch_size=4")
    seen = []
    act = ev.act

    def spy(agent, *a, **k):
        seen.append([t.name for t in agent.tools])
        return act(agent, *a, **k)

    monkeypatch.setattr(ev, "act", spy)
    out = ev.build_evaluator(cfg, agent_tok)(agent_model, 0)
    assert seen and all(names == ["add"] for names in seen)
    assert out["eval/num_prompts"] == 100
