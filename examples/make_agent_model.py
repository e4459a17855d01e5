"""Build the embedded tiny agent model (examples/agent_model/, ~4 MB) and its labeled agent traces
(examples/data/agent_traces.parquet).

The model
  - the demo's byte-level tokenizer (examples/make_base_model.py: one token per byte) plus six
    added tokens, as Qwen2.5 has them: `<|im_start|>`, `<|im_end|>` (the EOS, which ends every
    turn), and `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>` (not special,
    so decoding keeps them for a tool-call parser);
  - a Hermes/Qwen-style chat template with `tools` support: the tools as one compact system line
    each (`add(a:integer,b:integer)`: a byte tokenizer pays a token per character, so the JSON
    schema itself would cost ~200 positions), turns as `<|im_start|>role\\n...<|im_end|>\\n`, an
    assistant's calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, a tool's
    result as `<tool_response>...</tool_response>`. It keeps history as it is (a render of the
    first turns is a prefix of the next render), which `data/turns.py` relies on;
  - a random-init Qwen2 of the demo model's size (hidden 128, 4 layers, tied embeddings) with
    512 positions: enough for a few turns. It is untrained: SFT on the agent traces teaches it the
    format (docs/agents.md).

The traces: for each train prompt (examples/data/train_prompts.jsonl, "12+7="), RESPONSES
distinct scripted agent responses drawn with a fixed seed, each an assistant -> tool -> assistant
conversation or a direct answer: a correct `add` call, a call with a wrong operand, a call that
fails (a missing argument, or an unknown tool) and then a guess, or a guess without any call. The
agent they imitate mostly answers from memory (weights 3:1:1:1:8, guesses last), as a production
agent that skips its tools would; the demo's GRPO stage teaches the tool (examples/agent.yaml).
`final_reward` is `arith.trace_reward` of the last assistant turn (1.0 correct, <
0.29 wrong). Columns: input (messages), output (messages), tools (JSON text), final_reward, answer.
The train and held-out prompts again as chat messages (examples/data/agent_prompts.jsonl,
agent_eval_prompts.jsonl) for the online stage and the evaluation (examples/agent.yaml).

Rerun from the repo root (deterministic, seconds):
    .venv/bin/python examples/make_agent_model.py
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import AddedToken
from transformers import Qwen2Config, Qwen2ForCausalLM

import arith
from make_base_model import build_tokenizer

HERE = Path(__file__).resolve().parent
SEED = 1234
MAX_POSITIONS = 512
RESPONSES = 4  # per prompt
PROMPTS = 300  # every train prompt: 1200 rows
TURN_TOKENS = ["<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
EOS = "<|im_end|>"
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object",
                   "properties": {"a": {"type": "integer", "description": "first addend"},
                                  "b": {"type": "integer",
                                        "description": "second addend"}},
                   "required": ["a", "b"]}}}

# Every literal newline sits inside a Jinja string: transformers compiles templates with
# trim_blocks, which would eat a newline after a block tag.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\n' }}{%- for tool in tools %}{%- set f = tool.function "
    "if tool.function is defined else tool %}{{- f.name + '(' }}{%- if f.parameters is defined and "
    "f.parameters.properties is defined %}{%- for name, p in f.parameters.properties.items() %}{{- "
    "name + ':' + (p.type if p.type is defined else 'any') }}{%- if not loop.last %}{{- ',' }}{%- "
    "endif %}{%- endfor %}{%- endif %}{{- ')\n' }}{%- endfor %}{{- '<|im_end|>\n' }}{%- endif "
    "%}{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' }}{%- if m.role == 'tool' %}{{- "
    "'<tool_response>' + m.content + '</tool_response>' }}{%- elif m.content is string %}{{- "
    "m.content }}{%- endif %}{%- if m.role == 'assistant' and m.tool_calls %}{%- for tc in "
    "m.tool_calls %}{%- set fn = tc.function if tc.function is defined else tc %}{{- "
    "'<tool_call>{\"name\": \"' + fn.name + '\", \"arguments\": ' }}{{- fn.arguments if "
    "fn.arguments is string else fn.arguments | tojson }}{{- '}</tool_call>' }}{%- endfor %}{%- "
    "endif %}{{- '<|im_end|>\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- "
    "'<|im_start|>assistant\n' }}{%- endif %}"
)


def build_agent_tokenizer():
    """The demo's byte tokenizer with the turn and tool tokens added and the agent template."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": TURN_TOKENS})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tok.eos_token = EOS
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = MAX_POSITIONS
    return tok


def save_agent_tokenizer(tok, out: Path) -> None:
    """save_pretrained with the template inside tokenizer_config.json (transformers 4.x and 5.x)."""
    tok.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("backend", None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)


def build_agent_model(tok) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=512, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=None, dtype="float32")
    return Qwen2ForCausalLM(config)


def _call(name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def agent_response(a: int, b: int, rng: random.Random) -> list[dict]:
    """One scripted response: a tool call (right, wrong operand, failing) then an answer, or a
    guess."""
    guess = str(max(0, a + b + rng.choice([-2, -1, 0, 0, 1, 2])))
    kind = rng.choices(["correct", "wrong_operand", "missing_argument", "unknown_tool", "no_tool"],
                       weights=[3, 1, 1, 1, 8])[0]
    if kind == "no_tool":
        return [{"role": "assistant", "content": guess}]
    if kind == "correct":
        call, result, final = _call("add", {"a": a, "b": b}), str(a + b), str(a + b)
    elif kind == "wrong_operand":
        b2 = b + rng.choice([-1, 1]) if b > 0 else b + 1
        call, result = _call("add", {"a": a, "b": b2}), str(a + b2)
        final = result
    elif kind == "missing_argument":
        call, result, final = _call("add", {"a": a}), "error: add() missing argument 'b'", guess
    else:
        call, result, final = _call("sum", {"a": a, "b": b}), "error: unknown tool 'sum'", guess
    return [call,
            {"role": "tool", "name": call["tool_calls"][0]["function"]["name"], "content": result},
            {"role": "assistant", "content": final}]


def agent_rows(train: list[dict], seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for src in train:
        a, b = (int(x) for x in src["input"].rstrip("=").split("+"))
        responses: list[list[dict]] = []
        while len(responses) < RESPONSES:  # distinct responses: the loaders drop exact duplicates
            response = agent_response(a, b, rng)
            if response not in responses:
                responses.append(response)
        for response in responses:
            reward = arith.trace_reward(response[-1]["content"], src["answer"])
            rows.append({"input": [{"role": "user", "content": src["input"]}], "output": response,
                         "tools": json.dumps([ADD_TOOL]), "final_reward": reward,
                         "answer": src["answer"]})
    return rows


def chat_prompts(rows: list[dict]) -> list[dict]:
    """The demo's prompt rows as chat messages (a tool prompt must be messages), with answers."""
    return [{"input": [{"role": "user", "content": r["input"]}], "answer": r["answer"]}
            for r in rows]


def write_jsonl(rows: list[dict], out: Path) -> None:
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_traces(rows: list[dict], out: Path) -> None:
    """Messages as JSON-compatible structs; `arguments` is JSON text (schemas differ per tool)."""
    call = pa.struct(
        [
            ("type", pa.string()),
            ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
        ]
    )
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string()),
                         ("tool_calls", pa.list_(call))])
    schema = pa.schema([("input", pa.list_(message)), ("output", pa.list_(message)),
                        ("tools", pa.string()),
                        ("final_reward", pa.float64()), ("answer", pa.string())])
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "agent_model")
    ap.add_argument("--traces", type=Path, default=HERE / "data" / "agent_traces.parquet")
    args = ap.parse_args()
    torch.manual_seed(SEED)
    tok = build_agent_tokenizer()
    model = build_agent_model(tok)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(args.out, safe_serialization=True)
    save_agent_tokenizer(tok, args.out)
    train = [
        json.loads(x) for x in (HERE / "data" / "train_prompts.jsonl").read_text().splitlines() if x
    ]
    rows = agent_rows(train[:PROMPTS])
    write_traces(rows, args.traces)
    held_out = [json.loads(x)
                for x in (HERE / "data" / "eval_prompts.jsonl").read_text().splitlines() if x]
    write_jsonl(chat_prompts(train), args.traces.parent / "agent_prompts.jsonl")
    write_jsonl(chat_prompts(held_out), args.traces.parent / "agent_eval_prompts.jsonl")
    correct = sum(r["final_reward"] == 1.0 for r in rows)
    calls = sum(len(r["output"]) > 1 for r in rows)
    print(f"saved {args.out} ({sum(p.numel() for p in model.parameters()):,} "
          f"params, vocab {len(tok)}); wrote {args.traces}: {len(rows)} "
          f"rows, {calls} with a tool call, {correct} correct")


if __name__ == "__main__":
    main()
