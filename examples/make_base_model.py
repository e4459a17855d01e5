"""Build the embedded demo base model: examples/model/ (~1M-param Qwen2, char tokenizer, ~4 MB).

What it makes
  - a character-level tokenizer: byte-level BPE with no merges, so every ASCII character is one
    token (other UTF-8 characters are one token per byte, lossless). Ids: 0 <pad>, 1 <eos>, 2 <unk>,
    then 3 + byte value (259 tokens). Saved as a PreTrainedTokenizerFast with eos/pad/unk set and a
    plain-text chat template (messages are concatenated, an assistant turn ends with <eos>, so the
    user message "12+7=" renders as "12+7=");
  - a random-init Qwen2 (hidden 128, 4 layers, 4 heads / 2 KV heads, MLP 512, 64 positions,
    tied embeddings), supervised with preftune's own SFT (`examples/sft.yaml`, completion-only loss
    on answer + EOS) on the train split of examples/arith.py only until it *half-knows* the task:
    held-out greedy accuracy in [TARGET_ACC, MAX_ACC].
    RL sharpens what a base half-knows; a base that knows nothing or everything gives no signal.
    Measured with check_trl_grpo.py: a 0.24 base gained ~0 held-out, this 0.33 one +0.2..0.4;
  - examples/data/{train,eval}_prompts.jsonl with rows {"input": "12+7=", "answer": "19"}.

Rerun (deterministic, one thread, a few minutes on a CPU core), from the repo root, then
make_traces.py:
    .venv/bin/python examples/make_base_model.py
The committed examples/model was made by an earlier version of this script with a hand-written
SFT loop (same model, data, LR and batch size, its own batch sampling): 0.33 held-out. This version
reaches the same band with preftune's SFT; `--out runs/base` leaves the committed model alone.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

import arith

HERE = Path(__file__).resolve().parent
SEED = 1234
SPECIALS = ["<pad>", "<eos>", "<unk>"]
# Plain-text chat: contents concatenated; an assistant turn is closed by EOS like an SFT target.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% if m['role'] "
    "== 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)
MAX_POSITIONS = 64
MAX_NEW_TOKENS = 4  # longest answer "38" + EOS is 3 tokens
TARGET_ACC, MAX_ACC = 0.30, 0.40  # stop at the first eval inside this held-out accuracy band
MIN_STEPS, MAX_STEPS, EVAL_EVERY = 100, 600, 10
LR, BATCH_SIZE = 1e-3, 32


def byte_symbols() -> list[str]:
    """The 256 printable stand-ins a ByteLevel pre-tokenizer uses for bytes 0..255, in byte order:
    visible Latin-1 bytes stand for themselves, the rest map to chr(256 + k) in order."""
    visible = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    out, k = [], 0
    for b in range(256):
        if b in visible:
            out.append(chr(b))
        else:
            out.append(chr(256 + k))
            k += 1
    return out


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (so per ASCII character): a byte-level BPE with an empty merge list.

    Why byte-level rather than a raw character vocabulary: transformers 5 loads any qwen2 checkpoint
    through Qwen2Tokenizer, which rebuilds the pipeline as NFC + ByteLevel around tokenizer.json's
    vocab. Using that same pipeline here makes AutoTokenizer and the raw tokenizer.json agree.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIALS + byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=MAX_POSITIONS,
                                   chat_template=CHAT_TEMPLATE)


def save_tokenizer(tok: PreTrainedTokenizerFast, out: Path) -> None:
    """save_pretrained, then keep the chat template inside tokenizer_config.json and name the
    generic fast-tokenizer class, so transformers 4.x and 5.x both load it."""
    tok.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("backend", None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)


def build_model(tok: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    """Random-init ~1M-parameter Qwen2 sized for the 259-token vocabulary."""
    config = Qwen2Config(vocab_size=len(tok), hidden_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                         max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=None, dtype="float32")
    return Qwen2ForCausalLM(config)


@torch.no_grad()
def greedy_completions(model, tok, prompts: list[str],
                       max_new_tokens: int = MAX_NEW_TOKENS) -> list[str]:
    """Greedy continuations (left-padded batch), decoded with special tokens kept so the
    scorer can cut at the first <eos>."""
    was_training = model.training
    model.eval()
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(
        **enc, max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )  # (B, T + new)
    model.train(was_training)
    new = out[:, enc["input_ids"].shape[1]:]  # (B, new)
    return tok.batch_decode(new, skip_special_tokens=False)


def greedy_accuracy(model, tok, rows: list[dict]) -> float:
    """Mean 0/1 correctness of greedy completions on `rows`."""
    comps = greedy_completions(model, tok, [r["input"] for r in rows])
    return sum(arith.score(c, r["answer"]) for c, r in zip(comps, rows)) / len(rows)


def sft_until_band(init: Path, train: list[dict], work: Path) -> tuple[int, float, Path]:
    """Supervise the random-init model with preftune's SFT (examples/sft.yaml with overrides: the
    answer + EOS is the completion, the prompt carries no loss) on TRL prompt/completion rows, in
    segments of EVAL_EVERY steps: each segment resumes the previous one exactly (same data order,
    optimizer, RNG) with a larger max_steps and ends with a held-out greedy evaluation; stop at the
    first evaluation past MIN_STEPS inside [TARGET_ACC, MAX_ACC]. Returns (steps, accuracy, model
    folder).

    Constant LR on purpose: at equal greedy accuracy, a cosine-decayed base had flatter sampling
    (fewer correct samples at temperature 1), so GRPO got less signal and gained less.
    """
    from preftune.config import load_config
    from preftune.run.loop import train as preftune_train

    data = work / "sft_train.jsonl"
    write_jsonl(data, [{"prompt": r["input"], "completion": r["answer"]} for r in train])
    overrides = [f"model.name_or_path={init}", f"data.train={data}", f"output_dir={work / 'run'}",
                 f"seed={SEED}", f"optim.lr={LR}", "optim.lr_scheduler=constant",
                 "optim.max_grad_norm=0",
                 f"sft.batch_size={BATCH_SIZE}", f"sft.micro_batch_size={BATCH_SIZE}",
                 f"save_steps={EVAL_EVERY}",
                 "save_total_limit=1", "log.progress_bar=false", "eval.eval_steps=0"]
    for steps in range(MIN_STEPS, MAX_STEPS + 1, EVAL_EVERY):
        final = preftune_train(load_config(HERE / "sft.yaml", overrides + [f"max_steps={steps}"]))
        records = [json.loads(x) for x in (final.parent / "metrics.jsonl").read_text().splitlines()]
        acc = [r["eval/reward"] for r in records if "eval/reward" in r][-1]
        loss = [r["loss"] for r in records if "loss" in r][-1]
        print(f"step {steps:4d}  loss {loss:.3f}  held-out greedy acc {acc:.2f}", flush=True)
        if TARGET_ACC <= acc <= MAX_ACC:
            return steps, acc, final
        if acc > MAX_ACC:
            break
    sys.exit(f"SFT never stopped inside the band [{TARGET_ACC}, {MAX_ACC}]; retune LR/steps")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "model")
    ap.add_argument("--data", type=Path, default=HERE / "data")
    ap.add_argument("--work", type=Path, default=None,
                    help="scratch folder (default: a temporary one)")
    args = ap.parse_args()

    # One thread: the same bits on any machine (reduction order depends on the thread count), and
    # no spin-wait slowdown when the 2 cores are shared; the model is too small to gain from more.
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    # a load and a save per segment: keep the log to one line each
    hf_logging.disable_progress_bar()
    torch.manual_seed(SEED)
    train, evals = arith.make_split()
    write_jsonl(args.data / "train_prompts.jsonl", train)
    write_jsonl(args.data / "eval_prompts.jsonl", evals)

    tok = build_tokenizer()
    model = build_model(tok)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params: {n_params:,}  vocab: {len(tok)}  train/eval: {len(train)}/{len(evals)}")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        init = work / "init"
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(init, safe_serialization=True)
        tok.padding_side = "right"
        save_tokenizer(tok, init)
        steps, acc, final = sft_until_band(init, train, work)
        # final/ is float32 (model.dtype)
        model = Qwen2ForCausalLM.from_pretrained(final, dtype=torch.float32)
        model.save_pretrained(args.out, safe_serialization=True)
    save_tokenizer(tok, args.out)
    print(f"saved {args.out}: {steps} SFT steps, held-out greedy accuracy {acc:.2f}, train greedy "
          f"accuracy {greedy_accuracy(model, tok, train):.2f}")


if __name__ == "__main__":
    main()
