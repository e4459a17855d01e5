"""Data-parallel training: the one module that calls torch.distributed.

`Parallel` is handed to the loop, the checkpointer and the tasks; everything else sees only its
rank, world size and a few reductions. One process (no torchrun) gets a `Parallel` whose
collectives are identities, so the single-process path runs the same code.

Strategies (`distributed.strategy`):
  fsdp  FSDP2: `fully_shard` on each decoder block, then the root; parameters, gradients and
        optimizer state sharded over the ranks; bf16 compute with fp32 reduction for
        model.dtype=bfloat16.
  ddp   every rank holds the whole model; gradients are summed with one all-reduce per step
        (after all micro-batches, as DDP's no_sync does), so uneven micro-batch counts cannot hang.
  none  one process only.
Gradients are *summed* over ranks: each rank's loss is already weighted by the global batch's
normalisers (sequences, tokens), so the sum is the gradient of one pass over the global batch.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import weakref
from pathlib import Path

import torch

from preftune import tensorfile
from preftune.errors import KNOWN, UserError, same_error
from preftune.model import load as loader

log = logging.getLogger("preftune")


def _kind(e: BaseException) -> str:
    """The name of the known error class `e` is (a subclass travels as its known base)."""
    names = ("Preempted", "CheckpointDamaged", *(k.__name__ for k in KNOWN))
    return next(c.__name__ for c in type(e).__mro__ if c.__name__ in names)


def torchrun_env(env=os.environ) -> bool:
    """True when started by torchrun (or any launcher that sets its variables)."""
    return all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


class Parallel:
    """Rank, world size and the collectives the training code needs (identities on one process)."""

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0, strategy: str = "none",
                 device: torch.device | None = None):
        self.rank, self.world, self.local_rank, self.strategy = rank, world, local_rank, strategy
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.active = torch.distributed.is_available() and torch.distributed.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.active and self.strategy == "fsdp"

    # ---------------------------------------------------------------- collectives

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()

    def _reduce(self, values: list[float], op) -> list[float]:
        if not self.active or not values:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        torch.distributed.all_reduce(t, op=op)
        return t.tolist()

    def sum(self, *values: float) -> list[float]:
        return self._reduce(list(values), torch.distributed.ReduceOp.SUM if self.active else None)

    def max(self, *values: float) -> list[float]:
        return self._reduce(list(values), torch.distributed.ReduceOp.MAX if self.active else None)

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any rank (the preemption flag)."""
        return bool(self.max(float(flag))[0])

    def gather(self, obj) -> list:
        """`obj` of every rank, in rank order, on every rank (small Python objects)."""
        if not self.active:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def on_main(self, fn, *, share: bool = True):
        """Run `fn` on rank 0 only and hand its result to every rank (`share` False: to rank 0 only,
        None elsewhere); a known error there (UserError, TryAgain, Unavailable) is raised on every
        rank (so all exit with its code together instead of the others waiting for it)."""
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except KNOWN as e:
                if not self.active:
                    raise
                error = (_kind(e), str(e))
        if share:
            result, error = self.broadcast((result, error))
        else:
            error = self.broadcast(error)
        if error is not None:
            raise same_error(*error)
        return result

    def together(self, fn):
        """Run `fn` on every rank; a known error on any rank is raised on every rank (the lowest
        such rank's), so all exit with its code together instead of the others waiting at their next
        collective for a rank that has left (work split over ranks: each sees only its share)."""
        if not self.active:
            return fn()
        result, error = None, None
        try:
            result = fn()
        except KNOWN as e:
            error = (_kind(e), str(e))
        errors = [e for e in self.gather(error) if e is not None]
        if errors:
            raise same_error(*errors[0])
        return result

    def _comm_device(self) -> torch.device:
        return self.device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")

    # ---------------------------------------------------------------- batch split

    def split(self, n: int, what: str) -> slice:
        """This rank's contiguous share of n global items; n must divide evenly (checked at
        start-up)."""
        if n % self.world:
            raise UserError(f"{what}={n} is not divisible by the {self.world} ranks", where=what)
        k = n // self.world
        return slice(self.rank * k, (self.rank + 1) * k)

    def share(self, n: int) -> slice:
        """This rank's contiguous part of n items when n need not divide evenly (resampling rounds):
        the first n % world ranks get one more."""
        return slice(self._share_start(n, self.rank), self._share_start(n, self.rank + 1))

    def group_share(self, n: int, size: int) -> slice:
        """The shares (`share`) of this rank's group of `size` consecutive ranks, as one slice: what
        a tensor-parallel engine the group runs together samples."""
        first = self.rank - self.rank % size
        return slice(self._share_start(n, first), self._share_start(n, first + size))

    def _share_start(self, n: int, rank: int) -> int:
        """Where rank `rank`'s share of n items starts (rank == world: n)."""
        k, extra = divmod(n, self.world)
        return rank * k + min(rank, extra)

    def offset(self, n_local: int) -> tuple[int, int]:
        """(rows on lower ranks, rows on all ranks) for this rank's n_local rows."""
        counts = self.gather(n_local)
        return sum(counts[:self.rank]), sum(counts)

    def require_divisible(self, values: dict[str, int]) -> None:
        """Global batch sizes are split over the ranks: each must divide evenly (exit 78
        otherwise)."""
        bad = [f"{k}={v}" for k, v in values.items() if v % self.world]
        if bad:
            raise UserError(f"{', '.join(bad)} not divisible by the world size {self.world} (the "
                            "global batch "
                            "is split evenly over the ranks)", where=", ".join(k for k in values))

    def reduce_metrics(self, m: dict) -> dict:
        """Per-rank partial metrics -> global: keys ending _min/_max combine by min/max, the rest
        are partial sums (each rank pre-weights by its share of the global batch). A key missing on
        a rank (a NaN it skipped) is combined over the ranks that have it."""
        if not self.active:
            return m
        out: dict = {}
        for part in self.gather(m):
            for k, v in part.items():
                if k not in out:
                    out[k] = v
                elif k.endswith("_min"):
                    out[k] = min(out[k], v)
                elif k.endswith("_max"):
                    out[k] = max(out[k], v)
                else:
                    out[k] = out[k] + v
        return out

    # ---------------------------------------------------------------- model wrapping

    def load(self, cfg, path: str, *, trainable: bool = True, reshard_after_forward: bool = True):
        """`load.load_model` for this strategy, on this rank's device (the policy, or with
        `trainable` False the frozen reference). Under FSDP2 without LoRA only rank 0 reads the
        weights, into host memory: every rank builds the module on the meta device and shards it,
        then rank 0 sends each rank its shards and the buffers outside the state dict (rotary
        tables). So no other rank ever holds a whole weight, and no device the whole model (the
        32B sizing in docs/distributed.md: 131 GB of fp32 weights per rank otherwise)."""
        # bf16 mixed precision where load_model chose float32 masters under bf16 autocast
        def wrap(model):
            return self.wrap(model, mixed_bf16=loader.compute_dtype(model) is not None,
                             reshard_after_forward=reshard_after_forward)

        if not self.sharded or cfg.lora.enabled:  # LoRA: peft wraps the loaded module first
            return wrap(loader.load_model(cfg, path, trainable=trainable))
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # rank 0, host
        full = self.on_main(lambda: loader.load_model(cfg, path, trainable=trainable), share=False)
        # meta shards
        model = wrap(loader.load_model(cfg, path, trainable=trainable, weights=False))
        model.to_empty(device=self.device)
        set_model_state_dict(model, full.state_dict() if full is not None else {},
                             options=StateDictOptions(full_state_dict=True,
                                                      broadcast_from_rank0=True))
        sources = dict(full.named_buffers()) if full is not None else {}
        for name, buf in model.named_buffers():
            if full is not None:
                buf.copy_(sources[name])
            torch.distributed.broadcast(buf, src=0)
        log.info("model built on the meta device and sharded; weights sent by rank 0")
        return model

    def wrap(self, model, *, mixed_bf16: bool = False, reshard_after_forward: bool = True):
        """The policy (or the frozen reference) for this strategy, on this rank's device (a module
        on the meta device stays there: `load` gives it storage once it is sharded)."""
        if not next(model.parameters()).is_meta:
            model = model.to(self.device)
        if not self.active or self.strategy != "fsdp":
            return model
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if mixed_bf16
            else MixedPrecisionPolicy()
        )
        for block in decoder_blocks(model):
            fully_shard(block, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        # every log-prob pass is one forward of the root (whatever its layout), so all ranks, idle
        # ones included, issue the same all-gathers and reduce-scatters in order
        if any(p.requires_grad for p in model.parameters()):
            for mod in fsdp_modules(model):  # each block reduces its own gradients
                mod.set_gradient_divide_factor(1.0)  # sum over ranks, see the module docstring
                mod.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
        return model

    def sync_grads(self, model) -> None:
        """ddp: sum every gradient over the ranks (one flat all-reduce). fsdp reduce-scatters in
        backward."""
        if not self.active or self.strategy != "ddp":
            return
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # a parameter unused on this rank must still join the all-reduce
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        torch.distributed.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    def clip_grads(self, model, max_grad_norm: float) -> float:
        """Clip the gradients to `max_grad_norm` (when > 0, torch's clip_grad_norm_ rule) and return
        their global norm before clipping; under FSDP the sharded gradients' squares are summed over
        the ranks by one all-reduce."""
        if not self.sharded:
            params = [p for p in model.parameters() if p.grad is not None]
            if max_grad_norm > 0:
                return float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
            return (
                float(
                    torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params]))
                )
                if params
                else 0.0
            )
        local = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        sq = (
            torch.stack([g.detach().float().pow(2).sum() for g in local]).sum()
            if local
            else torch.zeros(())
        )
        sq = sq.to(self._comm_device())
        torch.distributed.all_reduce(sq)
        norm = sq.sqrt()
        if max_grad_norm > 0:  # torch's clip_grad_norm_ rule
            coef = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            for g in local:
                g.mul_(coef.to(g.device, g.dtype))
        return float(norm)

    @contextlib.contextmanager
    def gathered(self, model):
        """Whole parameters on every rank for generation: one all-gather per rollout (not one per
        token), sampling with no collective at all, then back to shards."""
        with whole(model) if self.sharded else contextlib.nullcontext():
            yield model

    def close(self) -> None:
        if self.active:
            with contextlib.suppress(Exception):
                torch.distributed.destroy_process_group()
            self.active = False


def decoder_blocks(model) -> list:
    """The repeated transformer layers (a ModuleList of the same block class, the longest one)."""
    best: list = []
    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > len(best) \
                and len({type(m) for m in mod}) == 1:
            best = list(mod)
    return best


# models inside `whole`, and how deep
_WHOLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def whole(model):
    """The whole parameters of an FSDP2-sharded model inside the block: each sharded module
    gathers once and keeps its parameters until the block ends (reads outside the modules'
    forwards, such as the decode step, see them whole). Nested blocks gather once; a model that
    is not sharded is left as it is."""
    depth = _WHOLE.get(model, 0)
    mods = (
        []
        if depth or not any(hasattr(m, "reshard") for m in model.modules())
        else fsdp_modules(model)
    )
    _WHOLE[model] = depth + 1
    for m in mods:
        m.set_reshard_after_forward(False)
        m.unshard()
    try:
        yield model
    finally:
        _WHOLE[model] = depth
        for m in mods:
            m.reshard()
            m.set_reshard_after_forward(True)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A parameter whole: an FSDP2 shard (a DTensor) all-gathered, a collective every rank runs in
    the same order; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def hf_weights(model):
    """(name, tensor) of every weight under its Hugging Face checkpoint name, whole, one at a time
    (a rollout engine's reload streams them): module order, so every rank gathers the same
    parameter at the same moment; LoRA merged into its base weight (W + scaling * B A); a tied
    weight once."""
    base, seen, lora = loader.base_module(model), set(), []
    for prefix, mod in base.named_modules():
        if any(prefix.startswith(p + ".") for p in lora):
            continue
        dot = f"{prefix}." if prefix else ""
        if hasattr(mod, "base_layer") and hasattr(mod, "lora_A"):  # a PEFT LoRA layer
            lora.append(prefix)
            w = full_tensor(mod.base_layer.weight)
            for key in mod.active_adapters:
                # (r, in), (out, r)
                a, b = full_tensor(mod.lora_A[key].weight), full_tensor(mod.lora_B[key].weight)
                w = w + (b.float() @ a.float()).mul_(mod.scaling[key]).to(w.dtype)  # (out, in)
            yield f"{dot}weight", w
            if getattr(mod.base_layer, "bias", None) is not None:
                yield f"{dot}bias", full_tensor(mod.base_layer.bias)
            continue
        for name, p in mod.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield f"{dot}{name}", full_tensor(p)


def fsdp_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def init(cfg, env=os.environ) -> Parallel:
    """Join torchrun's process group when its environment is there; else one process."""
    if not torchrun_env(env):
        return Parallel()
    rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    if cfg.strategy == "none" and world > 1:
        raise UserError(f"strategy none runs one process, but torchrun started {world}",
                        where="distributed.strategy")
    cuda = torch.cuda.is_available()
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if cuda else "gloo")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(backend=backend, rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=cfg.timeout_seconds))
    log.info("rank %d of %d (local %d): strategy %s, backend %s, device %s", rank,
             world, local, cfg.strategy, backend, device)
    return Parallel(rank, world, local, cfg.strategy, device)


# ---------------------------------------------------------------- state dicts and sharded files


def _options(*, full: bool = False, trainable_only: bool = False, strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full,
                            ignore_frozen_params=trainable_only,
                            strict=strict and not trainable_only)


def model_state(model, *, full: bool = False, trainable_only: bool = False) -> dict:
    """The model's state dict: this rank's shards (DTensors) or, with `full`, whole tensors on the
    CPU of rank 0 (an all-gather under FSDP: every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(full=full, trainable_only=trainable_only))


def optimizer_state(model, optimizer, *, full: bool = False) -> dict:
    """Optimizer state keyed by parameter name (so it loads into any world size and strategy)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(full=full))


def load_full_state(model, optimizer, weights: dict, optim: dict | None):
    """Whole-tensor weights (and name-keyed optimizer state) into a model of any strategy; returns
    the (missing, unexpected) keys of the weights."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    keys = set_model_state_dict(model, weights, options=_options(full=True, strict=False))
    if optim is not None:
        set_optimizer_state_dict(model, optimizer, optim, options=_options(full=True))
    return keys.missing_keys, keys.unexpected_keys


def save_sharded(model, optimizer, folder: Path, rank: int, *,
                 trainable_only: bool = False) -> None:
    """Each rank writes its pieces of the weights and optimizer state, data only (tensorfile.py):
    shards/rank-R.json (the structure; for each sharded tensor its global shape and this rank's
    offset in it) and shards/rank-R.safetensors (the pieces). Nothing is unpickled on reading them
    (torch.distributed.checkpoint's files are pickles, so they are not used)."""
    from safetensors.torch import save_file

    state = {"model": model_state(model, trainable_only=trainable_only),
             "optim": optimizer_state(model, optimizer)}
    pieces: dict[str, torch.Tensor] = {}

    def leaf(name: str, t: torch.Tensor) -> dict:
        local, offset = _local_piece(t)
        pieces[name] = local.detach().cpu().contiguous()
        return {"$shard": name, "shape": list(t.shape), "offset": offset}

    folder.mkdir(parents=True, exist_ok=True)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    doc = {"tree": tensorfile.encode(state, leaf), "rank": rank, "world": world}
    tensorfile.write_pair(folder / f"rank-{rank}", doc, pieces, save_file)


def _local_piece(t: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """This rank's piece of a (possibly distributed) tensor and its offset in the whole tensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(t, DTensor):
        return t, [0] * t.dim()
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), list(offset)


def shard_files(folder: Path) -> list[str]:
    """The file names of a shards/ folder, from rank-0.json's world size (never a glob)."""
    world = tensorfile.read_doc(folder / "rank-0").get("world")
    if not isinstance(world, int) or world < 1:
        raise tensorfile.TensorFileError("shards/rank-0.json has no world size")
    return [f"rank-{r}{ext}" for r in range(world) for ext in (tensorfile.JSON, tensorfile.TENSORS)]


def load_sharded(model, optimizer, folder: Path, *, trainable_only: bool = False,
                 weights_only: bool = False) -> None:
    """Pieces written at any world size, cut to this rank's (or one plain process's) layout: each
    tensor of this rank's state dict is filled from the saved pieces that overlap it. A piece
    missing, or a shape that does not fit, raises TensorFileError."""
    from safetensors import SafetensorError
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": model_state(model, trainable_only=trainable_only)}
    if not weights_only:
        state["optim"] = optimizer_state(model, optimizer)
    targets: dict[str, torch.Tensor] = {}
    tensorfile.encode(state, lambda name, t: targets.setdefault(name, t) is None)
    try:
        saved = _read_pieces(folder, targets, list(state))
    except (SafetensorError, OSError, KeyError, TypeError) as e:
        raise tensorfile.TensorFileError(
            f"shards are not readable: {type(e).__name__}: {e}"
        ) from None
    set_model_state_dict(model, saved["model"], options=_options(trainable_only=trainable_only))
    if not weights_only:
        set_optimizer_state_dict(model, optimizer, saved["optim"])


def _read_pieces(folder: Path, targets: dict[str, torch.Tensor], parts: list[str]) -> dict:
    """The saved tree's `parts` (model, optim), each sharded tensor filled into its target."""
    from safetensors import safe_open

    names = shard_files(folder)
    docs = [tensorfile.read_doc(folder / n.removesuffix(tensorfile.JSON)) for n in names[::2]]
    found: dict[str, dict] = {}
    for r, doc in enumerate(docs):
        tensorfile.decode(doc["tree"], lambda m,
                          r=r: found.setdefault(m.get("$shard"), {}).setdefault(r, m))
    with contextlib.ExitStack() as stack:
        files = [
            stack.enter_context(safe_open(str(folder / n), framework="pt")) for n in names[1::2]
        ]

        def tensor(marker: dict) -> torch.Tensor:
            name = marker.get("$shard")
            target = targets.get(name)
            if target is None or marker.get("shape") != list(target.shape):
                want = None if target is None else list(target.shape)
                raise tensorfile.TensorFileError(f"shards: {name} does not fit the model "
                                                 f"({marker.get('shape')} vs {want})")
            local, offset = _local_piece(target)
            pieces = [(m.get("offset"), files[r], name) for r, m in found.get(name, {}).items()]
            tensorfile.fill(local, offset, pieces, f"shards: {name}")
            return target

        return {k: tensorfile.decode(docs[0]["tree"][k], tensor) for k in parts}
