"""What the benches share beyond the harness: models, long prompts, a dense reward, the FLOP count,
per-phase timers, peak memory and the machine's measured matmul peak.

The FLOP count is nominal: the work as a framework without shortcuts does it (every row runs its
whole prompt, every row runs forward and backward), the same number for both frameworks, so
"MFU" = nominal FLOPs / time / matmul peak is throughput in common units. preftune skips part of
that work (shared prompts, zero-advantage rows), so its MFU can exceed what the hardware ran.
"""
from __future__ import annotations

import json
import resource
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
FILLER = "12+7=19. 3+4=7. 19+19=38. 0+0=0. 5+11=16. "  # byte-level tokenizer: one token per character


VOCABS = {"rand3m": None, "rand3m-v32k": 32768}  # None: the byte tokenizer's 259


def model_dir(name: str, out: str | Path) -> Path:
    """`demo` (examples/model, ~1M parameters), `rand3m` (a ~3M random-init Qwen2 with room for
    long contexts, written once into `out`, seeded), `rand3m-v32k` (the same body with a 32k
    vocabulary, as real tokenizers have: the byte tokenizer uses its first 259 rows) or a path."""
    if name == "demo":
        return EXAMPLES / "model"
    if name not in VOCABS:
        return Path(name)
    path = Path(out) / name
    if (path / "config.json").exists():
        return path
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    cfg = json.loads((EXAMPLES / "model" / "config.json").read_text())
    cfg.update(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=2048, layer_types=["full_attention"] * 4)
    if VOCABS[name]:
        cfg["vocab_size"] = VOCABS[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**{k: v for k, v in cfg.items() if k != "architectures"}))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(EXAMPLES / "model").save_pretrained(path)
    for f in (EXAMPLES / "model").glob("*.jinja"):
        shutil.copy(f, path)
    return path


def prompt_rows(prefix_len: int) -> list[dict]:
    """The a+b train prompts, each after a shared filler text of `prefix_len` characters (tokens)."""
    rows = [json.loads(line) for line in (EXAMPLES / "data" / "train_prompts.jsonl").read_text().splitlines() if line]
    prefix = (FILLER * (prefix_len // len(FILLER) + 1))[:prefix_len]
    return [{"input": prefix + r["input"], "answer": r["answer"]} for r in rows]


def digit_fraction(prompts, completions, **kwargs) -> list[float]:
    """Fraction of digit characters in the completion: a reward that differs between the samples
    of a random-init model (accuracy would be 0 for all, leaving nothing to train on)."""
    texts = [c if isinstance(c, str) else str(c) for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def model_shape(path: Path) -> dict:
    cfg = json.loads((Path(path) / "config.json").read_text())
    H, L, inter, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = H * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    body = L * (2 * H * H + 2 * H * kv + 3 * H * inter)  # multiply-adds per position: q,o + k,v + MLP
    return {"body": body, "head": H * V, "attn": L * H}


def forward_flops(shape: dict, rows: int, prompt: float, completion: float) -> float:
    """FLOPs of one forward over `rows` sequences of prompt+completion tokens, logits on the
    completion positions, causal attention (2 * L * H * s^2: scores and weighted sum)."""
    s = prompt + completion
    return rows * (2 * shape["body"] * s + 2 * shape["head"] * completion + 2 * shape["attn"] * s * s)


def grpo_flops(shape: dict, *, prompts: int, G: int, prompt: float, completion: float, beta: float,
               num_iterations: int) -> dict:
    """Nominal FLOPs per optimiser step by phase (sampling and the reference/old passes happen once
    per generation batch, i.e. every num_iterations steps)."""
    N = prompts * G
    fwd = forward_flops(shape, N, prompt, completion)
    # sampling: prompts prefilled once each (as both frameworks do), then one position per new token
    sampling = forward_flops(shape, prompts, prompt, 0) + N * completion * (
        2 * shape["body"] + 2 * shape["head"] + 2 * shape["attn"] * (prompt + completion / 2) * 2)
    passes = (beta > 0) + (num_iterations > 1)
    return {"sampling": sampling / num_iterations, "reference": passes * fwd / num_iterations,
            "forward": fwd, "backward": 2 * fwd}


def dpo_flops(shape: dict, *, pairs: int, prompt: float, response: float) -> dict:
    fwd = forward_flops(shape, 2 * pairs, prompt, response)
    return {"forward": fwd, "backward": 2 * fwd}


def peak_rss_mb() -> float:
    """This process's peak resident memory (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def matmul_peak_gflops(n: int = 1024, seconds: float = 1.0) -> float:
    """Measured float32 matmul throughput at the current thread count: the best of repeated n x n
    products over about `seconds` (the machine's practical peak, the MFU denominator)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    best, end = 0.0, time.perf_counter() + seconds
    torch.mm(a, b)
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t0) / 1e9)
    return best


class PhaseTimer:
    """Wall seconds spent in wrapped callables, by phase. Forward passes are split by autograd:
    with grad = the training forward, without = reference/old log-prob passes."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._depth = 0

    @contextmanager
    def phase(self, name: str):
        if self._depth:  # nested (a backward inside a timed forward would be counted twice)
            yield
            return
        self._depth += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def wrap(self, owner, attr: str, name: str | None = None) -> None:
        """Time owner.attr; name None = "forward" or "reference" by torch.is_grad_enabled()."""
        import torch

        fn = getattr(owner, attr)

        def timed(*a, **k):
            with self.phase(name or ("forward" if torch.is_grad_enabled() else "reference")):
                return fn(*a, **k)

        setattr(owner, attr, timed)

    def wrap_backward(self) -> None:
        import torch

        self.wrap(torch.Tensor, "backward", "backward")

