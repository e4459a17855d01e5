"""Load the policy, the reference model and the tokenizer from a local Hugging Face folder."""
from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import os
import pickle
import sys
import weakref
from pathlib import Path

import torch

from preftune.atomic import atomic_write
from preftune.config import ModelConfig
from preftune.errors import UserError, one_line
from preftune.model import hf_config
from preftune.model.core import CausalLM
from preftune.model.families import own_class, unsupported
from preftune.model.tokenizer import Tokenizer

# the names of CHOICES["model.dtype"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
log = logging.getLogger(__name__)
# Hugging Face modules loaded with float32 masters for bf16 compute (preftune's own module says so
# itself)
_MIXED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# What a broken model folder raises inside transformers / tokenizers / safetensors: a user error.
def _load_errors() -> tuple[type[BaseException], ...]:
    from safetensors import SafetensorError

    # UnpicklingError: a pytorch_model.bin that torch.load(weights_only=True) refuses (arbitrary
    # objects)
    return (OSError, ValueError, KeyError, EnvironmentError, SafetensorError,
            pickle.UnpicklingError)


def check_model_path(path: str) -> str:
    """The model must be a local Hugging Face folder with a config.json and weights; `path` was made
    relative to the config file by `config.resolve_local` (the one place paths are resolved)."""
    where = "model.name_or_path"
    if not os.path.exists(path):
        raise UserError(f"model folder not found: {path} (no model hub here: give a local folder)",
                        where=where)
    if not os.path.isdir(path):
        raise UserError(f"{path} is a file; give the model's folder "
                        "(with config.json and *.safetensors)",
                        where=where)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"{path} has no config.json: not a Hugging Face model folder", where=where)
    if not any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path)):
        raise UserError(f"{path} has no weights (*.safetensors or *.bin)", where=where)
    return path


def weights_signature(path: str) -> str:
    """Name, size and mtime of the model's weight files: a folder whose weights were replaced (same
    path) must not reuse what was computed from the old weights (cached reference log-probs, a
    loaded reward model)."""
    folder = Path(path)
    files = (
        sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
        if folder.is_dir()
        else []
    )
    return ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


_QUIET: dict = {"runs": 0}  # while runs go on: transformers' settings before they quieted it


@contextlib.contextmanager
def quiet_transformers():
    """While a run goes on, transformers' own bars (loading, writing shards) and warnings stay
    off: they would bury the run's. Its settings are put back after. A run that never imports
    transformers leaves it alone: it is quieted when the loaders import it (`hf_quiet`)."""
    _QUIET["runs"] += 1
    if "transformers" in sys.modules:
        hf_quiet()
    try:
        yield
    finally:
        _QUIET["runs"] -= 1
        saved = _QUIET.pop("saved", None) if not _QUIET["runs"] else None
        if saved is not None:
            from transformers.utils import logging as hf_logging

            if saved[0]:
                hf_logging.enable_progress_bar()
            hf_logging.set_verbosity(saved[1])


def hf_quiet() -> None:
    """Quiet transformers (imported now) if a run goes on and it is not quiet yet."""
    if not _QUIET["runs"] or "saved" in _QUIET:
        return
    from transformers.utils import logging as hf_logging

    _QUIET["saved"] = (hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity())
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def import_model_libraries(cfg: ModelConfig) -> None:
    """Import the model's libraries now (most of a restart on a small model), so start-up time
    shows as `startup/imports` and a signal then still finds the process in its start-up phase:
    for a folder the own module reads itself (`own_folder`), only the tokenizer's; else
    transformers and the model's own modeling module. Best effort: load_model reports any problem
    with the folder."""
    if own_folder(cfg, cfg.name_or_path):
        # torch's own lazy imports, here rather than inside the first step: the optimizer's
        # construction imports dynamo (and with it sympy), whatever the model
        import torch._dynamo  # noqa: F401
        return
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    hf_quiet()
    if cfg.trust_remote_code:
        return
    # the flag, always: without it transformers may ask on a terminal whether to run a folder's code
    try:
        MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(cfg.name_or_path,
                                                                    trust_remote_code=False))]
    except Exception:  # noqa: BLE001 - an unknown or missing model: load_model says what is wrong
        pass


def own_folder(cfg: ModelConfig, path: str) -> bool:
    """Whether the own module and the own tokenizer serve this folder with no transformers
    import: its config.json is one `hf_config` reads, and its tokenizer one `Tokenizer` does."""
    try:
        config = _own_config(cfg, path)
    except (OSError, ValueError):
        return False
    return config is not None and Tokenizer.from_folder(path) is not None


def _own_config(cfg: ModelConfig, path: str):
    """config.json read by `hf_config` when the own module runs this folder, else None."""
    if not cfg.lean_forward or cfg.trust_remote_code:
        return None
    config = hf_config.read(path)
    return config if config is not None and own_class(config) is not None else None


def _refuse_remote_code(e: BaseException, path: str, what: str) -> None:
    if "contains custom code" in str(e):
        raise UserError(f"the {what} in {path} maps to its own code (auto_map), which runs only "
                        "with "
                        "model.trust_remote_code: true", where="model.trust_remote_code") from None


def load_tokenizer(path: str, trust_remote_code: bool = False, *, own: bool = True):
    """The folder's tokenizer: preftune's own (`model/tokenizer.py`, no transformers import) for
    a folder it reads exactly, unless `own` is off (a caller that needs transformers' batching),
    else transformers'. `trust_remote_code` is passed as a bool on every load (config, tokenizer,
    model): None would let transformers prompt on a terminal and run a folder's `auto_map` code
    on a "y"."""
    tok = Tokenizer.from_folder(path) if own and not trust_remote_code else None
    if tok is None:
        from transformers import AutoTokenizer

        hf_quiet()
        try:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=bool(trust_remote_code))
        except _load_errors() as e:
            _refuse_remote_code(e, path, "tokenizer")
            raise UserError(f"cannot load tokenizer: {one_line(e)}", where=path) from None
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise UserError("tokenizer has neither a pad nor an eos token", where=path)
        tok.pad_token = tok.eos_token  # padding is masked everywhere, so reusing eos is safe
    return tok


def load_model(cfg: ModelConfig, path: str, *, trainable: bool = True, weights: bool = True):
    """The policy (trainable, optionally LoRA-wrapped) or a frozen copy for the reference:
    preftune's own module (`families.own_class`: the Llama family, GLM-4), else the Hugging Face
    module (also with `model.lean_forward: false`). Without `weights`, the same module on the meta
    device, from config.json alone (shapes, no storage: the FSDP2 ranks that receive their shards
    from rank 0)."""
    # Full fine-tuning in bfloat16 keeps float32 master weights and computes under autocast: AdamW
    # steps on bf16 weights round most updates away. Frozen models and LoRA bases load as bf16.
    mixed = trainable and cfg.dtype == "bfloat16" and not cfg.lora.enabled
    dtype, remote = torch.float32 if mixed else DTYPES[cfg.dtype], bool(cfg.trust_remote_code)
    try:
        config = _model_config(cfg, path)
        own = own_class(config) if cfg.lean_forward else None
        _say_path(config, own, cfg.lean_forward)
        if own is not None:
            model = own.from_pretrained(path, config, dtype=dtype, weights=weights,
                                        autocast_dtype=torch.bfloat16 if mixed else None)
        elif weights:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                         trust_remote_code=remote)
        else:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                         trust_remote_code=remote)
    except _load_errors() as e:  # corrupt or truncated weights, bad config.json
        _refuse_remote_code(e, path, "model")
        raise UserError(f"cannot load model: {one_line(e, with_type=True)}", where=path) from None
    if mixed and not isinstance(model, CausalLM):
        _MIXED[model] = torch.bfloat16
    generation = _generation_config(path, own=isinstance(model, CausalLM))
    if generation is not None:  # its stop ids and sampling defaults travel into every folder saved
        model.generation_config = generation
    if not trainable:
        model.eval().requires_grad_(False)
        return model
    if cfg.gradient_checkpointing:
        _checkpoint_blocks(model)
    if cfg.compile and isinstance(model, CausalLM):
        # per block, as FSDP2 wraps them: one graph serves every layer
        for block in model.model.layers:
            block.compile()
    if cfg.lora.enabled:
        model = _wrap_lora(model, cfg, path)
    model.train()
    return model


def _model_config(cfg: ModelConfig, path: str):
    """config.json read by `hf_config` when the own module runs it, else by transformers."""
    config = _own_config(cfg, path)
    if config is not None:
        return config
    from transformers import AutoConfig

    hf_quiet()
    return AutoConfig.from_pretrained(path, trust_remote_code=bool(cfg.trust_remote_code))


class GenerationFile:
    """generation_config.json as the folder holds it, written back unchanged (the own module's:
    transformers' `GenerationConfig` would import transformers for a file it only carries)."""

    def __init__(self, text: str):
        json.loads(text)  # a broken file stops the load, as GenerationConfig would
        self.text = text

    def save_pretrained(self, out: str | Path) -> None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "generation_config.json").write_text(self.text)


def _generation_config(path: str, *, own: bool):
    """The folder's generation_config.json (a `GenerationConfig`, or for the own module a
    `GenerationFile`), or None without one."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return None
    try:
        if own:
            return GenerationFile(Path(file).read_text())
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read generation_config.json: {one_line(e)}", where=path) from None


def save_generation_config(model, out: str | Path) -> None:
    """The model's generation config (from its folder) as OUT/generation_config.json, when it has
    one."""
    generation = getattr(base_module(model), "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(out))


_SAID: set = set()  # (model_type, path taken): each said once per process


def _say_path(config, own, lean_forward: bool) -> None:
    """Log once which module runs this model type and why."""
    why = "model.lean_forward: false" if not lean_forward else unsupported(config)
    path = (
        f"preftune's own module ({own.__name__})"
        if own is not None
        else f"the Hugging Face module ({why})"
    )
    key = (getattr(config, "model_type", None), path)
    if key not in _SAID:
        _SAID.add(key)
        log.info("model %s runs on %s", key[0], path)


def _checkpoint_blocks(model) -> None:
    """Activation checkpointing per block: its activations are recomputed in backward."""
    if isinstance(model, CausalLM):
        model.checkpointing = True
        return
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def base_module(model):
    """The module under a LoRA wrapper (PEFT), or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def compute_dtype(model) -> torch.dtype | None:
    """bf16 for a model loaded with float32 master weights for bf16 compute, else None."""
    base = base_module(model)
    return base.autocast_dtype if isinstance(base, CausalLM) else _MIXED.get(base)


def device_of(model) -> torch.device:
    """Where `model` (or one parameter) computes: its parameters' device, except for FSDP2 shards
    kept in host memory (distributed.cpu_offload), which each forward gathers onto their mesh's
    device, this process's current one. Inputs and outputs go there."""
    t = model if isinstance(model, torch.Tensor) else next(model.parameters())
    mesh = getattr(t, "device_mesh", None)  # a DTensor's
    if mesh is None or mesh.device_type == t.device.type:
        return t.device
    kind = mesh.device_type
    return torch.device(kind, torch.get_device_module(kind).current_device())


def autocast(model):
    """The compute-precision context for a forward pass of `model` (bf16 autocast for mixed
    precision)."""
    dtype = compute_dtype(model)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_of(model).type, dtype=dtype)


def to_device(host, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor (or list) on `device` without making the host wait for it: a copy from pageable
    memory to a GPU first waits for everything queued on the GPU (a sync per micro-batch); from
    pinned memory it is queued behind that work instead."""
    t = host if isinstance(host, torch.Tensor) else torch.tensor(host, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _wrap_lora(model, cfg: ModelConfig, path: str):
    try:
        from peft import LoraConfig, get_peft_model
        hf_quiet()
    except ImportError:
        raise UserError("model.lora.enabled needs peft: pip install 'preftune[lora]'",
                        where="model.lora") from None
    targets, own = cfg.lora.target_modules, isinstance(model, CausalLM)
    # PEFT's rule for a transformers model: every linear but the head
    if own and targets == "all-linear":
        targets = list(type(model).PROJECTIONS)
    lcfg = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                      target_modules=targets, task_type=None if own else "CAUSAL_LM")
    wrapped = get_peft_model(model, lcfg)
    if own and wrapped.peft_config["default"].target_parameters:  # PEFT rewrote MLP targets
        raise UserError(f"{model.config.model_type} in preftune's own module adapts "
                        f"{', '.join(type(model).PROJECTIONS)}: PEFT moves gate/up/down_proj onto "
                        "its 3-D experts, which the own module does not adapt",
                        where="model.lora.target_modules")
    # adapter_config.json names the base, as PEFT and TRL write it: from_pretrained(adapter folder)
    # finds it
    wrapped.peft_config["default"].base_model_name_or_path = os.path.abspath(path)
    return wrapped


def save_pretrained(model, tokenizer, out: str | Path, *, dtype: str | None = None) -> None:
    """Hugging Face format (safetensors + config + tokenizer); LoRA adapters are merged first.
    `dtype` casts the saved weights (the final model of a bf16 run); checkpoints keep the master
    weights as they are so a resume is exact."""
    to_save = model
    if hasattr(model, "merge_and_unload") and hasattr(model, "peft_config"):
        to_save = copy.deepcopy(model).merge_and_unload()
    state = None
    if dtype is not None and DTYPES[dtype] != next(to_save.parameters()).dtype:
        state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k,
                 v in to_save.state_dict().items()}
    to_save.save_pretrained(str(out), safe_serialization=True, state_dict=state)
    save_generation_config(to_save, out)
    if state is not None:  # transformers writes the in-memory dtype into config.json
        cfg_file = Path(out) / "config.json"
        cfg_json = json.loads(cfg_file.read_text())
        cfg_json["dtype"] = dtype
        atomic_write(cfg_file, json.dumps(cfg_json, indent=2) + "\n")
    tokenizer.save_pretrained(str(out))


def save_folder_files(model, tokenizer, out: str | Path, *, dtype: str) -> None:
    """Everything of a Hugging Face folder but its weights: config.json saying the weights'
    `dtype`, the generation config, the tokenizer (the weights are written apart, sharded:
    distributed/weights.py)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base = base_module(model)
    base.config.save_pretrained(str(out))
    cfg_file = out / "config.json"
    cfg_json = json.loads(cfg_file.read_text())
    atomic_write(cfg_file, json.dumps(cfg_json | {"dtype": dtype}, indent=2) + "\n")
    save_generation_config(base, out)
    tokenizer.save_pretrained(str(out))


def cache_kwarg(model) -> str:
    """transformers renamed `past_key_values` to `cache` in 5.x; use whichever the model takes."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return (
        "cache"
        if "cache" in inspect.signature(type(base).forward).parameters
        else "past_key_values"
    )
