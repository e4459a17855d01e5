"""`preftune plan`: the memory a run needs, term by term and phase by phase, its step time and its
cost, from config.json (no weights), the run config and the node type. Pure arithmetic: no torch.

Sizes are in GB (1e9 bytes). P is a parameter count; each term says its arithmetic. The terms follow
what the code does (docs/plan.md): FSDP2 shards parameters, gradients and AdamW's two moments over
the ranks and gathers one block at a time (plus the prefetch of the next) for the training passes;
the own sampler and the reference pass gather the whole model; each rank reads only its own rows
of the weights and writes final/ one gathered tensor at a time (the own module without LoRA; else
rank 0 reads the whole model and final/ is gathered to its host memory).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from preftune.deploy.nodes import InstanceType
from preftune.deploy.plan_time import run_cost, step_time
from preftune.errors import UserError
from preftune.model import hf_config

GB = 1e9
CHUNK_ELEMENTS = 1 << 25  # model/head.py (torch): restated here, a test holds them equal
# model/llama.py
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
OWN_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")  # model/llama.ARCHITECTURES
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CUDA_PROCESS_GB = 3.0  # a CUDA process's own host memory (libraries, context): stated, not measured
CUDA_RESERVE_GB = 2.0  # per GPU: CUDA context, NCCL buffers (stated, not measured)
FITS, TIGHT = 0.90, 1.0  # peak / capacity: fits below 0.90, tight up to 1.0, else does not fit
POD_MARGIN = 1.2  # the Pod's memory request: the host peak + 20%


@dataclass(frozen=True)
class Shape:
    """A Llama-family model's sizes, from config.json."""
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    max_positions: int | None
    qkv_bias: bool
    qk_norm: bool
    file_bytes: int  # bytes per weight in the folder's files (config.json's dtype)
    model_type: str

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def linear(self, name: str) -> tuple[int, int]:
        """(in, out) of a block's projection."""
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, self.q), "k_proj": (h, self.kv),
                "v_proj": (h, self.kv), "o_proj": (self.q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[name]

    @property
    def block_linear(self) -> int:
        return sum(a * b for a, b in map(self.linear, PROJECTIONS))

    @property
    def block(self) -> int:
        bias = self.q + 2 * self.kv if self.qkv_bias else 0
        return (
            self.block_linear + bias + 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        )

    @property
    def embed(self) -> int:
        return self.vocab * self.hidden

    @property
    def root(self) -> int:
        """The parameters outside the blocks: embeddings, final norm, head (unless tied)."""
        return self.embed * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.block + self.root

    @property
    def matmul(self) -> int:
        """Multiply-adds per token: every block's projections and the head."""
        return self.layers * self.block_linear + self.embed

    def lora(self, r: int, targets) -> int:
        names = PROJECTIONS if targets == "all-linear" else [t for t in PROJECTIONS if t in targets]
        return self.layers * sum(r * sum(self.linear(n)) for n in names)


def read_shape(folder: str, where: str = "model.name_or_path") -> Shape:
    """The shape of the model in `folder` (a model folder or a config.json): config.json only."""
    path = Path(folder)
    path = path if path.suffix == ".json" else path / "config.json"
    if "://" in str(folder):
        raise UserError(f"{folder} is not a local folder: pass --model-config with its config.json",
                        where=where)
    if not path.is_file():
        raise UserError(f"{path.parent} has no config.json: not a Hugging Face model folder",
                        where=where)
    try:
        c = json.loads(path.read_text())
        c = {**c, **c.get("text_config", {})}
        heads = int(c["num_attention_heads"])
        known = hf_config.layout(hf_config.FolderConfig(c))
        return Shape(
            layers=int(c["num_hidden_layers"]), hidden=int(c["hidden_size"]),
            intermediate=int(c["intermediate_size"]), heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
            vocab=int(c["vocab_size"]),
            tied=bool(c.get("tie_word_embeddings", False)),
            max_positions=c.get("max_position_embeddings"),
            # an unknown model type: sized as a Llama with biases where config.json says so
            qkv_bias=known.qkv_bias if known else bool(c.get("attention_bias", False)),
            qk_norm=known.qk_norm if known else False,
            file_bytes=BYTES.get(str(c.get("dtype") or c.get("torch_dtype") or "bfloat16"), 2),
            model_type=str(c.get("model_type")))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read a model shape: {type(e).__name__} {e}",
                        where=str(path)) from None


@dataclass
class Term:
    name: str
    gb: float
    how: str
    host: bool = False  # host memory (CPU) rather than the GPU's
    rank0: bool = False  # only rank 0 holds it

    def as_dict(self) -> dict:
        return {"name": self.name, "gb": round(self.gb, 6), "how": self.how,
                "host": self.host, "rank0": self.rank0}


@dataclass
class Phase:
    name: str
    terms: list[Term] = field(default_factory=list)

    def add(self, name: str, nbytes: float, how: str, **kw) -> None:
        if nbytes > 0:
            self.terms.append(Term(name, nbytes / GB, how, **kw))

    def total(self, *, host: bool, rank0: bool = True) -> float:
        return sum(t.gb for t in self.terms if t.host == host and (rank0 or not t.rank0))


@dataclass
class Job:
    """What the memory depends on, derived once from the config and the world."""
    algorithm: str
    world: int
    strategy: str  # fsdp, ddp or none
    lora: bool
    mixed: bool  # bf16 compute over float32 masters
    master: int  # bytes per parameter held
    compute: int  # bytes per element computed
    trainable: int
    rows: int  # sequences per rank per step (the generation batch's share)
    micro: int  # sequences per micro-batch
    seq: int  # tokens per sequence
    tokens: int  # tokens of a micro-batch as laid out
    head_positions: int  # positions reaching the head per sequence
    checkpointing: bool
    own: bool  # preftune's own module (chunked head) rather than the Hugging Face module
    reference: str  # none, model (a frozen copy), adapter (the base under LoRA), precomputed
    sampler: str  # none, own, vllm
    offload: bool = False  # FSDP2 CPU offload: the sharded state in host memory


def job_of(cfg, shape: Shape, world: int) -> Job:
    a, m = cfg.algorithm, cfg.model
    strategy = cfg.distributed.strategy if world > 1 else "none"
    mixed = m.dtype == "bfloat16" and not m.lora.enabled
    master = 4 if (mixed or m.dtype == "float32") else 2
    trainable = shape.lora(m.lora.r, m.lora.target_modules) if m.lora.enabled else shape.params
    if a == "grpo":
        g = cfg.grpo
        seq = cfg.data.max_prompt_length + g.max_completion_length
        rows, micro = g.prompts_per_step * g.num_generations, g.micro_batch_size
        head = g.max_completion_length + 1
        reference = ("adapter" if m.lora.enabled else "model") if g.beta > 0 else "none"
        sampler = "none" if g.rollout == "offline" else ("vllm" if g.use_vllm else "own")
    else:
        sec = getattr(cfg, a)
        seq, head, sampler = sec.max_length, sec.max_length, "none"
        pairs = 2 if a == "dpo" else 1
        rows, micro = sec.batch_size * pairs, sec.micro_batch_size * pairs
        live = a == "dpo" and not cfg.dpo.precompute_ref_logps and not cfg.dpo.reference_free
        reference = "none" if a == "sft" or (a == "dpo" and cfg.dpo.reference_free) else (
            ("adapter" if m.lora.enabled else "model") if live else "precomputed")
    rows = max(1, math.ceil(rows / world))
    own = m.lean_forward and shape.model_type in OWN_MODEL_TYPES
    micro = min(micro, rows)
    tokens = micro * seq
    if a == "grpo" and own:  # the packer lays a group's prompt out once (model/logps._plan)
        g = cfg.grpo
        tokens = (
            micro * g.max_completion_length
            + math.ceil(micro / g.num_generations) * cfg.data.max_prompt_length
        )
    return Job(a, world, strategy, m.lora.enabled, mixed, master,
               2 if m.dtype == "bfloat16" else 4, trainable,
               rows, micro, seq, tokens, head, m.gradient_checkpointing, own, reference, sampler,
               offload=cfg.distributed.cpu_offload and strategy == "fsdp")


def check_lengths(cfg, shape: Shape) -> None:
    """Sequences longer than the model's positions: a UserError naming the key."""
    if not shape.max_positions:
        return
    a = cfg.algorithm
    key, n = ((f"{a}.max_length", getattr(cfg, a).max_length) if a != "grpo" else
              ("grpo.max_completion_length",
               cfg.data.max_prompt_length + cfg.grpo.max_completion_length))
    if n > shape.max_positions:
        extra = " + data.max_prompt_length" if a == "grpo" else ""
        raise UserError(f"{n} tokens per sequence exceed the model's max_position_embeddings "
                        f"({shape.max_positions}){extra}", where=key)


def _fmt(n: float) -> str:
    return f"{n / 1e9:.3g}e9" if n >= 1e8 else f"{n:,.0f}"


# ---------------------------------------------------------------- memory, per process and phase


def _state(p: Phase, s: Shape, j: Job, *, grads: bool, adam: bool,
           filled: bool = False) -> None:
    """What every phase holds: this rank's parameters, gradients, AdamW moments, reference. CPU
    offload keeps them in each rank's host memory; `filled`: the load, where the shards are filled
    on the GPU (the collectives' device) before they move to the host."""
    share = 1 / j.world if j.strategy == "fsdp" else 1
    per = f" / {j.world}" if share < 1 else ""
    host = j.offload and not filled
    per += ", in host memory" if host else ""
    frozen = s.params if j.lora else 0
    p.add("parameters" + (" (LoRA base, frozen)" if j.lora else ""),
          (j.trainable if not j.lora else frozen) * j.master * share,
          f"{_fmt(j.trainable if not j.lora else frozen)} x {j.master} B{per}", host=host)
    if j.lora:
        p.add("LoRA adapter", j.trainable * 4 * share, f"{_fmt(j.trainable)} x 4 B{per}",
              host=host)
    if grads:
        p.add("gradients", j.trainable * 4 * share, f"{_fmt(j.trainable)} x 4 B{per}", host=host)
    if adam:
        p.add("AdamW moments", j.trainable * 8 * share, f"{_fmt(j.trainable)} x 8 B{per}",
              host=host)
    if j.reference == "model":
        p.add("reference model", s.params * j.compute * share,
              f"{_fmt(s.params)} x {j.compute} B{per}", host=host)


def _activation_bytes(s: Shape, j: Job) -> tuple[float, float]:
    """(bytes kept per token per block, bytes of one block's working set per token): the tensors the
    own module's backward keeps (the norms' inputs and outputs, rotated q, k, v, attention's output
    and o_proj's input, the MLP's gate, silu(gate), up and their product)."""
    kept = 4 * s.hidden + 3 * s.q + 2 * s.kv + 4 * s.intermediate
    if j.mixed:  # residual stream and norms in float32, projections' inputs and outputs in bf16
        return 2 * s.hidden * 4 + (kept - 2 * s.hidden) * 2, kept * 2
    return kept * j.compute, kept * j.compute


def _passes(p: Phase, s: Shape, j: Job, *, grad: bool) -> None:
    """A training (or no-grad) pass over one micro-batch: gathered blocks, activations, logits,
    mask."""
    tokens = j.tokens
    if j.strategy == "fsdp":
        p.add("gathered block + prefetch", 2 * s.block * j.compute,
              f"2 x {_fmt(s.block)} x {j.compute} B")
        # FSDP2 gathers into one flat buffer (after copying the shards into another) and then
        # copies out into the parameters: while the prefetch lands, its block is there twice
        p.add("prefetch's all-gather buffers", s.block * j.compute * (1 + 1 / j.world),
              f"{_fmt(s.block)} x {j.compute} B x (1 + 1/{j.world})")
        p.add("gathered embeddings + head", s.root * j.compute, f"{_fmt(s.root)} x {j.compute} B")
        if grad and not j.lora:
            p.add("a block's gradient before reduce-scatter", s.block * 4, f"{_fmt(s.block)} x 4 B")
    kept, block = _activation_bytes(s, j)
    if not grad:
        p.add("activations (no grad, one block)", tokens * block,
              f"{tokens:,} tokens x {block:,.0f} B")
    elif j.checkpointing:
        res = 4 if j.mixed else j.compute
        p.add("activations, checkpointed (block inputs)", tokens * s.hidden * res * s.layers,
              f"{tokens:,} tokens x {s.hidden} x {res} B x {s.layers} blocks")
        p.add("one block recomputed + its gradients", 2 * tokens * block,
              f"2 x {tokens:,} tokens x {block:,.0f} B")
    else:
        p.add("activations", tokens * kept * s.layers,
              f"{tokens:,} tokens x {kept:,.0f} B x {s.layers} blocks")
        p.add("backward working set (one block)", tokens * block,
              f"{tokens:,} tokens x {block:,.0f} B")
    k = j.micro * j.head_positions
    copies = 3 if grad else 1
    if j.own and k * s.vocab > CHUNK_ELEMENTS:
        p.add("logits, chunked head", copies * CHUNK_ELEMENTS * 4,
              f"{copies} x {CHUNK_ELEMENTS:,} x 4 B")
    else:
        p.add("logits", copies * k * s.vocab * 4, f"{copies} x {k:,} positions x {s.vocab:,} x 4 B")
    if j.micro > 1 and j.own:  # packed rows: one additive float mask and its boolean
        width = min(tokens, 8 * j.seq)
        p.add("attention mask (packed rows)", tokens * width * (j.compute + 1),
              f"{tokens:,} x {width:,} x {j.compute + 1} B")


def _engine(s: Shape, j: Job, cfg, gpu_gb: float | None) -> tuple[float, float, str]:
    """(engine GB, KV cache GB, how) of a colocated vLLM engine on one GPU."""
    g = cfg.grpo
    weights = s.params * 2 / g.vllm_tensor_parallel_size / GB
    if gpu_gb is None:  # CPU: the KV cache is its own key, the weights the engine's copy
        return (
            weights + g.vllm_kv_cache_gib * 2**30 / GB,
            g.vllm_kv_cache_gib * 2**30 / GB,
            "CPU engine",
        )
    total = g.vllm_gpu_memory_utilization * gpu_gb
    return total, total - weights, (f"{g.vllm_gpu_memory_utilization:g} x {gpu_gb:g} GB (weights "
                                    f"{weights:.1f} GB at TP {g.vllm_tensor_parallel_size})")


def phases(cfg, s: Shape, j: Job, gpu_gb: float | None) -> list[Phase]:
    """Each phase's terms for one process (rank 0 where ranks differ)."""
    gpu = gpu_gb is not None
    load = Phase("load")
    read_dtype = 2 if j.lora and cfg.model.dtype == "bfloat16" else j.master
    _read(load, s, j, "weights", read_dtype)
    if gpu or j.strategy == "fsdp":
        _state(load, s, j, grads=False, adam=False, filled=True)
        load.terms = [t for t in load.terms if t.name != "reference model"]
    out = [load]
    if j.reference == "model":
        ref = Phase("load ref")
        _state(ref, s, j, grads=False, adam=False)
        for t in ref.terms:  # offloaded, its shards are filled on the GPU first, as the policy's
            if t.name == "reference model" and t.host:
                t.host, t.how = False, t.how.replace("in host memory", "filled on the GPU")
        _read(ref, s, j, "reference", j.compute, built=j.strategy == "fsdp" or gpu)
        out.append(ref)
    if j.reference in ("model", "precomputed"):
        rp = Phase("ref pass")
        _state(rp, s, j, grads=False, adam=j.algorithm == "grpo")
        if j.strategy == "fsdp":
            rp.add("whole reference gathered", s.params * j.compute,
                   f"{_fmt(s.params)} x {j.compute} B")
        _passes(rp, s, j, grad=False)
        out.append(rp)
    if j.sampler != "none":
        out.append(_generate(cfg, s, j, gpu_gb))
    if j.sampler == "vllm" and cfg.grpo.vllm_importance_sampling_correction:
        out.append(_correction(cfg, s, j, gpu_gb))
    train = Phase("train")
    _state(train, s, j, grads=True, adam=True)
    _passes(train, s, j, grad=True)
    if j.sampler == "vllm" and not (gpu and cfg.grpo.vllm_enable_sleep_mode):
        train.add("vLLM engine (awake)", _engine(s, j, cfg, gpu_gb)[0] * GB,
                  _engine(s, j, cfg, gpu_gb)[2])
    out.append(train)
    out.append(_final(cfg, s, j))
    return out


def _sliced(j: Job) -> bool:
    """Under FSDP2 each rank builds the own module on the meta device and reads only its rows of
    each tensor (with LoRA, PEFT wraps the whole module first: each rank loads it whole)."""
    return j.own and j.strategy == "fsdp" and not j.lora


def _read(p: Phase, s: Shape, j: Job, what: str, held: int, *, built: bool = True) -> None:
    """Host memory while reading a model: the own module, the largest tensor as stored and cast
    (the embedding; `_sliced`, each rank's rows of it) and, unless sliced, the whole model it
    fills; the Hugging Face module, the whole model as stored and the model built from it (under
    FSDP2 on rank 0 only)."""
    if j.own:  # one tensor at a time (model/hf_files.py)
        rows = math.ceil(s.vocab / (j.world if _sliced(j) else 1)) * s.hidden
        part = "'s slice" if _sliced(j) else ""
        p.add(f"{what}: largest tensor{part} read", rows * (s.file_bytes + held),
              f"{_fmt(rows)} x ({s.file_bytes} + {held}) B", host=True)
        if built and not _sliced(j):  # filled in host memory, then moved to its device
            p.add("model being built" if what == "weights" else "reference being built",
                  s.params * held, f"{_fmt(s.params)} x {held} B", host=True)
        return
    fsdp_read = j.strategy == "fsdp" and not j.lora  # only rank 0 reads
    name = "weights as stored (read)" if what == "weights" else "reference as stored (read)"
    p.add(name, s.params * s.file_bytes, f"{_fmt(s.params)} x {s.file_bytes} B", host=True,
          rank0=fsdp_read)
    if built:
        p.add("model being built" if what == "weights" else "reference being built",
              s.params * held, f"{_fmt(s.params)} x {held} B", host=True, rank0=fsdp_read)


def _generate(cfg, s: Shape, j: Job, gpu_gb: float | None) -> Phase:
    gen = Phase("generate")
    _state(gen, s, j, grads=False, adam=True)
    if j.sampler == "vllm":
        total, kv, how = _engine(s, j, cfg, gpu_gb)
        tp = cfg.grpo.vllm_tensor_parallel_size
        gen.add("vLLM engine weights", (total - kv) * GB, f"{_fmt(s.params)} x 2 B / TP {tp}")
        # below 0: the weights alone overflow
        gen.terms.append(Term("vLLM KV cache", kv, f"{how} - weights"))
        gen.add("weight push: largest tensor gathered", s.embed * 4, f"{_fmt(s.embed)} x 4 B")
        return gen
    low = 2 if j.mixed else j.compute
    if j.strategy == "fsdp":
        gen.add("whole model gathered", s.params * low, f"{_fmt(s.params)} x {low} B")
    held = low if j.strategy == "fsdp" else j.master  # FSDP2 gathers in the compute dtype
    fused = (
        s.block_linear
        if low != held
        else sum(
            s.linear(n)[0] * s.linear(n)[1] for n in PROJECTIONS if n not in ("o_proj", "down_proj")
        )
    )
    gen.add("decoding weights (fused q/k/v, gate/up)", s.layers * fused * low,
            f"{s.layers} x {_fmt(fused)} x {low} B")
    kv_tok = 2 * s.layers * s.kv * low
    gen.add("KV cache", j.rows * j.seq * kv_tok, f"{j.rows} rows x {j.seq} tokens x {kv_tok:,} B")
    gen.add("decode logits + sampling noise", 3 * j.rows * s.vocab * 4,
            f"3 x {j.rows} x {s.vocab:,} x 4 B")
    return gen


def _correction(cfg, s: Shape, j: Job, gpu_gb: float | None) -> Phase:
    """The engine's importance correction: a no-grad pass of the policy on gathered parameters."""
    cor = Phase("correct")
    _state(cor, s, j, grads=False, adam=True)
    if j.strategy == "fsdp":
        cor.add("whole model gathered", s.params * j.compute, f"{_fmt(s.params)} x {j.compute} B")
    if not (gpu_gb is not None and cfg.grpo.vllm_enable_sleep_mode):
        total, _, how = _engine(s, j, cfg, gpu_gb)
        cor.add("vLLM engine (awake)", total * GB, how)
    _passes(cor, s, j, grad=False)
    return cor


def _final(cfg, s: Shape, j: Job) -> Phase:
    """final/ of the own module, one tensor at a time (LoRA merged into each): in one process each
    cast to model.dtype as it is written; under FSDP2 every rank all-gathers each on its device
    and the rank whose file holds it copies it to the host in model.dtype. Otherwise under FSDP the
    whole float32 state gathered to rank 0's host and a model built from it; the saved copy in
    model.dtype when that differs from the weights held."""
    fin = Phase("final")
    _state(fin, s, j, grads=False, adam=True)
    out_bytes = BYTES[cfg.model.dtype]
    if j.own:
        if j.strategy != "fsdp":
            fin.add(f"largest tensor in {cfg.model.dtype}, to its file", s.embed * out_bytes,
                    f"{_fmt(s.embed)} x {out_bytes} B", host=True)
            return fin
        fin.add("largest tensor gathered", s.embed * j.master, f"{_fmt(s.embed)} x {j.master} B")
        if out_bytes != j.master:  # cast on the device before the copy to the host
            fin.add(f"its cast to {cfg.model.dtype}", s.embed * out_bytes,
                    f"{_fmt(s.embed)} x {out_bytes} B")
        fin.add(f"it in {cfg.model.dtype}, to its file", s.embed * out_bytes,
                f"{_fmt(s.embed)} x {out_bytes} B", host=True)
        return fin
    if j.strategy == "fsdp":
        fin.add("whole state gathered to host", s.params * j.master,
                f"{_fmt(s.params)} x {j.master} B", host=True, rank0=True)
        fin.add("model built from it", s.params * j.master,
                f"{_fmt(s.params)} x {j.master} B", host=True, rank0=True)
    if j.lora:
        fin.add("merged copy", s.params * out_bytes,
                f"{_fmt(s.params)} x {out_bytes} B", host=True, rank0=True)
    if out_bytes != j.master:
        fin.add(f"copy in {cfg.model.dtype}", s.params * out_bytes,
                f"{_fmt(s.params)} x {out_bytes} B", host=True, rank0=True)
    return fin


# ---------------------------------------------------------------- the plan


@dataclass
class Target:
    """Where the job runs: `node` (an instance type) x `nodes`, or this machine's CPU (`node`
    None)."""
    name: str
    nodes: int
    procs_per_node: int
    node: InstanceType | None = None
    host_gb: float = 0.0  # per node
    capacity_type: str = "spot"

    @property
    def world(self) -> int:
        return self.nodes * self.procs_per_node


def make_plan(cfg, shape: Shape, target: Target, *, mfu: float = 0.3, gen_tps: float = 1000.0,
              prices: dict | None = None) -> dict:
    """The plan as a dict (what `--json` prints): per process (GPU) and per host, each phase's
    terms, the peak, headroom and verdict, the step time and the cost per iteration."""
    check_lengths(cfg, shape)
    j = job_of(cfg, shape, target.world)
    gpu_gb = target.node.gpu_gb if target.node else None
    ph = phases(cfg, shape, j, gpu_gb)
    plan = {"job": _summary(cfg, shape, j, target),
            "phases": [{"name": p.name, "terms": [t.as_dict() for t in p.terms]}
                       for p in ph]}
    if target.node:
        per_gpu = {p.name: p.total(host=False) + CUDA_RESERVE_GB for p in ph}
        plan["gpu"] = _verdict(per_gpu, target.node.gpu_gb,
                               f"runtime: CUDA context + NCCL {CUDA_RESERVE_GB:g} GB")
        plan["gpu"]["runtime_gb"] = {p.name: CUDA_RESERVE_GB for p in ph}
        others = {p.name: target.procs_per_node * CUDA_PROCESS_GB
                  + (target.procs_per_node - 1) * p.total(host=True, rank0=False) for p in ph}
        host0 = {p.name: p.total(host=True) + others[p.name] for p in ph}
        plan["host"] = _verdict(host0, target.host_gb,
                                f"rank 0's node; runtime: {target.procs_per_node} processes x "
                                f"{CUDA_PROCESS_GB:g} GB + the other ranks' own host terms")
        plan["host"]["runtime_gb"] = {k: round(v, 3) for k, v in others.items()}
        plan["host"]["pod_memory"] = (
            f"{math.ceil(plan['host']['peak_gb'] * POD_MARGIN * GB / 2**30)}Gi"
        )
        plan["time"] = step_time(cfg, shape, j, target, mfu, gen_tps)
        plan["cost"] = run_cost(cfg, target, plan["time"], prices)
    else:
        per = {p.name: p.total(host=False) + p.total(host=True) for p in ph}
        plan["process"] = _verdict(per, target.host_gb / target.procs_per_node,
                                   "per process, above the interpreter and its libraries")
    # what the engine takes and, with sleep mode on a GPU, gives back for training
    if j.sampler == "vllm":
        total, kv, _ = _engine(shape, j, cfg, gpu_gb)
        plan["vllm"] = {
            "engine_gb": round(total, 3),
            "kv_cache_gb": round(kv, 3),
            "handed_back_gb": round(total, 3)
            if gpu_gb and cfg.grpo.vllm_enable_sleep_mode
            else 0.0,
        }
    fits = [plan[k]["verdict"] for k in ("gpu", "host", "process") if k in plan]
    if plan.get("vllm", {}).get("kv_cache_gb", 1) <= 0:
        fits.append("does not fit")
    plan["verdict"] = (
        "does not fit" if "does not fit" in fits else "tight" if "tight" in fits else "fits"
    )
    return plan


def _verdict(per_phase: dict[str, float], capacity: float, note: str) -> dict:
    phase, peak = max(per_phase.items(), key=lambda kv: kv[1])
    ratio = peak / capacity if capacity else math.inf
    verdict = "fits" if ratio <= FITS else "tight" if ratio <= TIGHT else "does not fit"
    return {"per_phase_gb": {k: round(v, 3) for k, v in per_phase.items()},
            "peak_gb": round(peak, 3),
            "peak_phase": phase, "capacity_gb": round(capacity, 3),
            "headroom_gb": round(capacity - peak, 3), "verdict": verdict, "note": note}


def _summary(cfg, s: Shape, j: Job, t: Target) -> dict:
    return {
        "algorithm": j.algorithm,
        "model": f"{s.model_type}, {s.params / 1e9:.3g}B parameters, {s.layers} layers, hidden "
        f"{s.hidden}, vocabulary {s.vocab:,}",
        "params": s.params,
        "where": (
            f"{t.nodes} x {t.name} ({t.node.gpus} x {t.node.gpu} {t.node.gpu_gb:g} GB)"
            if t.node
            else f"{t.name}, {t.procs_per_node} process(es)"
        ),
        "ranks": j.world,
        "strategy": j.strategy,
        "cpu_offload": j.offload,
        "dtype": cfg.model.dtype,
        "lora": j.lora,
        "gradient_checkpointing": j.checkpointing,
        "sequences_per_rank": j.rows,
        "micro_batch": j.micro,
        "tokens_per_sequence": j.seq,
        "reference": j.reference,
        "sampler": j.sampler,
        "module": "own (chunked head)" if j.own else "Hugging Face",
    }
