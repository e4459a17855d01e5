"""What the benches share beyond the harness: models, long prompts, a dense reward, the FLOP count,
per-phase timers, peak memory and the machine's measured matmul peak.

The FLOP count is nominal: the work as a framework without shortcuts does it (every row runs its
whole prompt, every row runs forward and backward), the same number for both frameworks, so
"MFU" = nominal FLOPs / time / matmul peak is throughput in common units. preftune skips part of
that work (shared prompts, zero-advantage rows), so its MFU can exceed what the hardware ran.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# byte-level tokenizer: one token per character
FILLER = "12+7=19. 3+4=7. 19+19=38. 0+0=0. 5+11=16. "


# Generated random-init Qwen2 models by name: these config fields over examples/model's config.json.
# All use its byte tokenizer (259 tokens), which covers the first rows of a larger vocabulary.
_RAND3M = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
           "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 2048}  # ~3M, room for long contexts
SHAPES = {
    "rand3m": _RAND3M,
    "rand3m-v32k": _RAND3M | {"vocab_size": 32768},  # the vocabulary size of real tokenizers
    # the same body in the other families the own module runs (issue 38's speed rows)
    "rand3m-glm4": _RAND3M | {"model_type": "glm4", "head_dim": 64,
                              "partial_rotary_factor": 0.5},
    "rand3m-moe": _RAND3M | {"model_type": "qwen3_moe", "head_dim": 64, "num_experts": 8,
                             "num_experts_per_tok": 2, "moe_intermediate_size": 384,
                             "norm_topk_prob": True},
    # Qwen2.5-0.5B's shape (494M parameters), for the GPU table. Stored in bfloat16, as that model
    # is published: half the bytes to write and to read in each of the suite's runs, and both
    # benches load float32 master weights explicitly, so the stored precision does not change what
    # they train.
    "rand0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                 "num_attention_heads": 14,
                 "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
                 "rope_parameters": {"rope_theta": 1e6,
                                     "rope_type": "default"}, "rms_norm_eps": 1e-6,
                 "max_position_embeddings": 4096, "dtype": "bfloat16"},
}
# Sampled from, a random model's next token is about uniform over its vocabulary: with the byte
# tokenizer 99.8% of rand0.5b's rows would decode to nothing, every completion would score 0, no
# group would have an advantage (and preftune would skip their rows). So its tokenizer names every
# row (`name_all_rows`).
NAMED_ROWS = {"rand0.5b"}


def model_dir(name: str, out: str | Path) -> Path:
    """`demo` (examples/model, ~1M parameters), a name of SHAPES (a seeded random-init Qwen2,
    written once into `out`) or a path."""
    if name == "demo":
        return EXAMPLES / "model"
    if name not in SHAPES:
        return Path(name)
    path = Path(out) / name
    if not (path / "config.json").exists():
        # a run killed while writing leaves no half model behind
        tmp = path.with_name(name + ".partial")
        write_model(name, tmp)
        shutil.rmtree(path, ignore_errors=True)  # what an older writer, interrupted, left there
        tmp.rename(path)
    return path


def generated_config(name: str) -> dict:
    """The config.json fields of the generated model `name` (examples/model's, then
    SHAPES[name])."""
    cfg = json.loads((EXAMPLES / "model" / "config.json").read_text())
    cfg.pop("architectures")
    cfg.update(SHAPES[name])
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    return cfg


def write_model(name: str, path: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = generated_config(name)
    model_type = cfg.pop("model_type", "qwen2")
    shutil.rmtree(path, ignore_errors=True)
    torch.manual_seed(0)
    # initialised on the CPU, in the stored dtype: the same weights on every machine, and a bf16
    # init of the 0.5B model takes seconds on a GPU host's cores
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg),
                                             dtype=getattr(torch, cfg["dtype"]))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(EXAMPLES / "model").save_pretrained(path)
    for f in (EXAMPLES / "model").glob("*.jinja"):
        shutil.copy(f, path)
    if name in NAMED_ROWS:
        name_all_rows(path, cfg["vocab_size"])


def name_all_rows(path: Path, vocab_size: int) -> None:
    """Extend the byte tokenizer in `path` to `vocab_size` entries: row i >= 259 decodes to three
    printable ASCII characters (base 94). There are no merges, so text still encodes one token per
    character."""
    file = Path(path) / "tokenizer.json"
    tok = json.loads(file.read_text())
    vocab = tok["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        k = i - 259
        vocab["".join(chr(33 + (k // 94 ** j) % 94) for j in (2, 1, 0))] = i
    if len(vocab) != vocab_size:
        raise ValueError(f"{file}: {len(vocab)} entries, expected {vocab_size}")
    file.write_text(json.dumps(tok, ensure_ascii=False))


def prompt_rows(prefix_len: int) -> list[dict]:
    """The a+b train prompts, each after a shared filler text of `prefix_len` characters
    (tokens)."""
    rows = [
        json.loads(line)
        for line in (EXAMPLES / "data" / "train_prompts.jsonl").read_text().splitlines()
        if line
    ]
    prefix = (FILLER * (prefix_len // len(FILLER) + 1))[:prefix_len]
    return [{"input": prefix + r["input"], "answer": r["answer"]} for r in rows]


def digit_fraction(prompts, completions, **kwargs) -> list[float]:
    """Fraction of digit characters in the completion: a reward that differs between the samples
    of a random-init model (accuracy would be 0 for all, leaving nothing to train on)."""
    texts = [c if isinstance(c, str) else str(c) for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def config_of(model: Path | dict) -> dict:
    return (
        model if isinstance(model, dict) else json.loads((Path(model) / "config.json").read_text())
    )


def model_shape(model: Path | dict) -> dict:
    """Multiply-adds per position of the body and the lm_head, and L * H for attention, from a model
    folder or its config dict."""
    cfg = config_of(model)
    H, L, inter, V = (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
    )
    kv = H * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    # multiply-adds per position: q,o + k,v + MLP
    body = L * (2 * H * H + 2 * H * kv + 3 * H * inter)
    return {"body": body, "head": H * V, "attn": L * H}


def param_count(model: Path | dict) -> int:
    """Parameters of a Qwen2 from its config, without building it: the body's matrices, the q/k/v
    biases, two norms per layer and the final one, the embedding, and an lm_head unless it is
    tied."""
    cfg = config_of(model)
    H, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = H * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    embeddings = V * H * (1 if cfg.get("tie_word_embeddings", True) else 2)
    return model_shape(cfg)["body"] + L * (H + 2 * kv + 2 * H) + H + embeddings


def forward_flops(shape: dict, rows: int, prompt: float, completion: float) -> float:
    """FLOPs of one forward over `rows` sequences of prompt+completion tokens, logits on the
    completion positions, causal attention (2 * L * H * s^2: scores and weighted sum)."""
    s = prompt + completion
    return rows * (
        2 * shape["body"] * s + 2 * shape["head"] * completion + 2 * shape["attn"] * s * s
    )


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


def cuda_used() -> bool:
    """Both frameworks train on CUDA when it is there (preftune's device, TRL's use_cpu=False)."""
    import torch

    return torch.cuda.is_available()


def reset_peak_cuda() -> None:
    """Start a framework's peak GPU memory afresh (both run in one process with --in-process)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_cuda_gib() -> float | None:
    """Peak GPU memory held by tensors (torch.cuda.max_memory_allocated) in GiB; None without
    CUDA."""
    import torch

    return torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else None


def peak_key(bf16: bool) -> tuple[str, str, int]:
    """(dtype, device, n) of the matmul peak for rows in this precision on this machine: n x n
    products, 8192 on a GPU (large enough to reach its tensor-core peak), 1024 on CPU."""
    dtype = "bfloat16" if bf16 else "float32"
    device = "cuda" if cuda_used() else "cpu"
    return dtype, device, 8192 if device == "cuda" else 1024


def matmul_peak_gflops(n: int = 1024, seconds: float = 1.0, dtype: str = "float32",
                       device: str = "cpu") -> float:
    """Measured matmul throughput (the machine's practical peak, the MFU denominator): the best of
    repeated n x n products in `dtype` on `device` over about `seconds`, at the current thread count
    on CPU. On CUDA, products are queued in batches of 10 with a synchronize around each (one
    product is a kernel launch), after a warm-up that loads cuBLAS and raises the clocks."""
    import torch

    a = torch.randn(n, n, dtype=getattr(torch, dtype), device=device)
    b = torch.randn(n, n, dtype=getattr(torch, dtype), device=device)
    cuda, batch = device.startswith("cuda"), 10 if device.startswith("cuda") else 1
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3 * batch):
        torch.mm(a, b)
    sync()
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(batch):
            torch.mm(a, b)
        sync()
        best = max(best, batch * 2 * n ** 3 / (time.perf_counter() - t0) / 1e9)
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



def run_args(ap, model: str | None) -> None:
    """The options every multi-variant script takes (bench_ranks.py, bench_vllm.py)."""
    ap.add_argument("--model", default=model,
                    help="the workloads' model" if model else "replace every workload's model")
    ap.add_argument("--model-cache", help="folder for generated models (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--only", action="append", help="run only workloads whose name contains this")
    ap.add_argument("--json", help="write the results here")


def run_workloads(names, measure, args, title: str, table) -> dict:
    """measure(name) for each workload --only selects, a line as each ends; then `title`, the
    table of all rows, and the rows as --json."""
    t0, rows = time.perf_counter(), {}
    for name in names:
        if not args.only or any(o in name for o in args.only):
            rows[name] = measure(name)
            print(f"[{time.perf_counter() - t0:5.0f}s] {name}: {json.dumps(rows[name])}",
                  flush=True)
    print(f"\n{title}: {args.steps} steps ({args.warmup} warmup), {os.cpu_count()} CPUs\n")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows
