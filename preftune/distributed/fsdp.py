"""FSDP2 and DDP applied from outside the model: loading a policy or reference for a strategy
(`load`), sharding it (`wrap`), summing (`sync_grads`) and clipping (`clip_grads`) gradients over
the ranks, and the whole parameters of a sharded model for generation (`whole`, a no-op on a
model that is not sharded). Free functions
of a `Parallel` (distributed/group.py), as torchtitan applies its parallelisms."""
from __future__ import annotations

import contextlib
import logging
import weakref

import torch

from preftune.distributed import weights
from preftune.distributed.group import Parallel
from preftune.errors import UserError, one_line
from preftune.model import load as loader
from preftune.model.hf_files import stored

log = logging.getLogger("preftune")



def load(dp: Parallel, cfg, path: str, *, trainable: bool = True,
         reshard_after_forward: bool = True, sliced: bool = True):
    """`load.load_model` for this strategy, on this rank's device (the policy, or with
    `trainable` False the frozen reference). Under FSDP2 without LoRA every rank builds the module
    on the meta device and shards it, then reads only its own rows of each parameter from the
    safetensors files (distributed/weights.py) and computes the rotary tables itself: no process
    holds a whole weight beyond the one tensor being read (the 32B sizing in
    docs/distributed.md), per-expert Qwen3-MoE checkpoints included (each rank stacks its own
    experts). The Hugging Face module, a checkpoint that does not fit the model, or `sliced` False
    takes the whole-model path instead: rank 0 reads everything into host memory and sends each
    rank its shards."""
    # bf16 mixed precision where load_model chose float32 masters under bf16 autocast
    def shard(model):
        return wrap(dp, model, mixed_bf16=loader.compute_dtype(model) is not None,
                    reshard_after_forward=reshard_after_forward)

    if not dp.sharded or cfg.lora.enabled:  # LoRA: peft wraps the loaded module first
        return shard(loader.load_model(cfg, path, trainable=trainable))
    model = shard(loader.load_model(cfg, path, trainable=trainable, weights=False))  # meta shards
    model.to_empty(device=dp.device)
    tensors = dp.together(lambda: _read_errors(lambda: stored(path), path))  # headers, read once
    why = weights.sliceable(model, tensors)
    if why is None and sliced:
        dp.together(lambda: _read_errors(lambda: weights.read_shards(model, tensors), path))
        model.fill_buffers()
        if dp.offloaded:
            to_host(dp, model)
        log.info("model built on the meta device and sharded; each rank read its own slices")
        return model
    log.info("rank 0 reads the whole model and sends the shards: %s", why or "asked to")
    return _load_from_rank0(dp, cfg, path, model, trainable)


def _read_errors(fn, path: str):
    """`fn()`, a broken weight file as the user error load_model raises for it."""
    from safetensors import SafetensorError

    try:
        return fn()
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        raise UserError(f"cannot load model: {one_line(e, with_type=True)}", where=path) from None


def _load_from_rank0(dp: Parallel, cfg, path: str, model, trainable: bool):
    """The whole-model path: rank 0 reads every weight into host memory and broadcasts them into
    the sharded `model` (given storage), with the buffers outside the state dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # rank 0, host
    full = dp.on_main(lambda: loader.load_model(cfg, path, trainable=trainable), share=False)
    set_model_state_dict(model, full.state_dict() if full is not None else {},
                         options=StateDictOptions(full_state_dict=True,
                                                  broadcast_from_rank0=True))
    sources = dict(full.named_buffers()) if full is not None else {}
    for name, buf in model.named_buffers():
        if full is not None:
            buf.copy_(sources[name])
        torch.distributed.broadcast(buf, src=0)
    if dp.offloaded:
        to_host(dp, model)
    log.info("model built on the meta device and sharded; weights sent by rank 0")
    return model


def to_host(dp: Parallel, model) -> None:
    """The shards of an offloaded model into (pinned) host memory, where FSDP2 wants them before
    the first forward; the buffers (rotary tables) stay on the device, which reads them as they
    are. Module._apply is FSDP2's here: it re-registers (and pins) each moved shard."""
    model.cpu()
    for mod in model.modules():
        for name, buf in mod._buffers.items():
            if buf is not None:
                mod._buffers[name] = buf.to(dp.device)


def wrap(dp: Parallel, model, *, mixed_bf16: bool = False, reshard_after_forward: bool = True):
    """The policy (or the frozen reference) for this strategy, on this rank's device (a module
    on the meta device stays there: `load` gives it storage once it is sharded). Offloaded
    (`dp.offloaded`), its shards are in host memory and each fully_shard moves only its own
    block through the device, so no device ever holds the whole model."""
    if not next(model.parameters()).is_meta and not dp.offloaded:
        model = model.to(dp.device)
    if not dp.active or dp.strategy != "fsdp":
        return model
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                        fully_shard)

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_bf16
        else MixedPrecisionPolicy()
    )
    # pinned host memory lets the copies to and from the device overlap compute (none to pin on
    # a CPU-only machine)
    offload = (CPUOffloadPolicy(pin_memory=dp.device.type == "cuda") if dp.offloaded
               else OffloadPolicy())
    for block in decoder_blocks(model):
        fully_shard(block, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    offload_policy=offload)
    fully_shard(model, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                offload_policy=offload)
    # every log-prob pass is one forward of the root (whatever its layout), so all ranks, idle
    # ones included, issue the same all-gathers and reduce-scatters in order
    if any(p.requires_grad for p in model.parameters()):
        for mod in fsdp_modules(model):  # each block reduces its own gradients
            mod.set_gradient_divide_factor(1.0)  # sum over ranks, see the module docstring
            mod.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    return model

def sync_grads(dp: Parallel, model) -> None:
    """ddp: sum every gradient over the ranks (one flat all-reduce). fsdp reduce-scatters in
    backward."""
    if not dp.active or dp.strategy != "ddp":
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

def clip_grads(dp: Parallel, model, max_grad_norm: float) -> float:
    """Clip the gradients to `max_grad_norm` (when > 0, torch's clip_grad_norm_ rule) and return
    their global norm before clipping; under FSDP the sharded gradients' squares are summed over
    the ranks by one all-reduce."""
    if not dp.sharded:
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
    sq = sq.to(dp.comm_device())
    torch.distributed.all_reduce(sq)
    norm = sq.sqrt()
    if max_grad_norm > 0:  # torch's clip_grad_norm_ rule
        coef = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in local:
            g.mul_(coef.to(g.device, g.dtype))
    return float(norm)


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
    # each module's own setting comes back on exit (the root's may differ from the blocks')
    before = [_reshards(m) for m in mods]
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield model
    finally:
        _WHOLE[model] = depth
        for m, after in zip(mods, before):
            m.reshard()
            m.set_reshard_after_forward(after, recurse=False)


def _reshards(m) -> bool:
    """Whether FSDP2 module `m` frees its gathered parameters after forward (its configured
    `reshard_after_forward`; torch keeps it as the groups' post-forward mesh)."""
    groups = m._get_fsdp_state()._fsdp_param_groups
    return all(g.post_forward_mesh_info is not None for g in groups)


def fsdp_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]
