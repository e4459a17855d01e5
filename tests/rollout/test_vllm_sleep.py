"""Sleep mode (grpo.vllm_enable_sleep_mode) without a GPU: the real VLLMEngine's push/sleep code on
a recording stand-in for `vllm.LLM`, with `on_gpu` forced on. It checks the order vLLM documents
for a level-2 sleep (wake the weights, reload, wake the KV cache), that an asleep engine never
samples, and that the training loop samples awake and trains asleep."""
from __future__ import annotations

import re

import pytest
import torch

from preftune.algorithms import grpo
from preftune.config import load_config
from preftune.data.tensors import left_pad
from preftune.rollout.sampler import sample
from preftune.rollout.vllm import EngineError, VLLMEngine
from preftune.run import loop
from preftune.distributed.group import Parallel
from tests.conftest import EVAL_PROMPTS, MODEL_DIR, TRAIN_PROMPTS
from tests.run.test_resume import data_dir, overrides  # noqa: F401 - fixture used by name


class RecordingLLM:
    """The calls VLLMEngine makes of `vllm.LLM`, in order; a reload drains the weights stream."""

    def __init__(self):
        self.calls: list = []
        self.tensors = 0

    def sleep(self, level: int = 1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))

    def collective_rpc(self, method, kwargs=None):
        if method == "reload_weights":
            self.tensors = sum(1 for _ in kwargs["weights_iterator"])
        self.calls.append(("rpc", method if isinstance(method, str) else method.__name__))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def fake_engine(*, sleep_mode: bool, on_gpu: bool) -> VLLMEngine:
    """A VLLMEngine around a RecordingLLM, as __init__ would set it up without starting vLLM."""
    cfg = load_config(None, [f"model.name_or_path={MODEL_DIR}", f"data.train={TRAIN_PROMPTS}", "grpo.use_vllm=true",
                             f"grpo.vllm_enable_sleep_mode={str(sleep_mode).lower()}"])
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.cfg, engine.model_cfg, engine.pushes, engine.asleep, engine.tp = cfg.grpo, cfg.model, 0, False, 1
    engine.on_gpu, engine.llm = on_gpu, RecordingLLM()
    return engine


def test_a_level_2_sleep_is_undone_by_the_next_push(model):
    engine = fake_engine(sleep_mode=True, on_gpu=True)
    engine.push(model)
    assert engine.llm.calls == [("rpc", "reload_weights"), ("reset_prefix_cache",)]
    assert engine.llm.tensors == len(model.state_dict()) - 1  # the tied head once, as the embedding
    engine.llm.calls.clear()
    engine.sleep()
    engine.sleep()  # already asleep: nothing more
    assert engine.llm.calls == [("sleep", 2)] and engine.asleep
    with pytest.raises(EngineError, match="asleep"):  # level 2 discarded the weights: sampling now is garbage
        engine.generate([[1, 2]], [0], num_generations=1, max_new_tokens=2, eos_id=0, pad_id=0)
    engine.llm.calls.clear()
    engine.push(model)
    assert engine.llm.calls == [("wake_up", ("weights",)), ("rpc", "reload_weights"), ("wake_up", ("kv_cache",)),
                                ("reset_prefix_cache",)]
    assert not engine.asleep and engine.pushes == 2


@pytest.mark.parametrize("sleep_mode, on_gpu", [(True, False), (False, True)])
def test_sleep_is_a_no_op_on_cpu_and_when_off(model, sleep_mode, on_gpu):
    engine = fake_engine(sleep_mode=sleep_mode, on_gpu=on_gpu)
    engine.sleep()
    assert engine.llm.calls == [] and not engine.asleep
    engine.push(model)
    assert ("wake_up", ("weights",)) not in engine.llm.calls
    assert (("rpc", "_refresh_cpu_prepacking") in engine.llm.calls) == (not on_gpu)  # the CPU backend's prepacked weights


def test_the_loop_samples_awake_and_trains_asleep(data_dir, tmp_path, monkeypatch):  # noqa: F811
    """A 3-step online run with in-training eval: every generation batch and every eval is push,
    sample, sleep; every pass with gradients runs while the engine sleeps."""
    engine, events = fake_engine(sleep_mode=True, on_gpu=True), []
    pushed = {}

    def push(model):
        events.append("push")
        pushed["model"] = model
        return VLLMEngine.push(engine, model)

    def generate(prompts, positions, *, num_generations, max_new_tokens, eos_id, pad_id, temperature=1.0,
                 top_p=1.0, top_k=0, greedy=False, seed=0, step=0, round_=0, turn=0, generator=None, model=None):
        assert not engine.asleep
        events.append("generate")
        ids, mask = left_pad(prompts, pad_id)
        return sample(pushed["model"], ids, mask, num_generations=num_generations, max_new_tokens=max_new_tokens,
                      eos_id=eos_id, pad_id=pad_id, temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy,
                      generator=torch.Generator().manual_seed(seed + step), with_logps=True)

    def sleep():
        VLLMEngine.sleep(engine)
        events.append("sleep")

    engine.push, engine.generate, engine.sleep = push, generate, sleep
    monkeypatch.setattr(grpo, "start_engine", lambda cfg, dp=None: engine)
    grad_passes_awake = []

    def on_forward(module, args):
        if torch.is_grad_enabled():
            grad_passes_awake.append(not engine.asleep)

    cfg = load_config(None, overrides("online", tmp_path / "run", data_dir, max_steps=3, save_steps=0,
                                      **{"grpo.use_vllm": "true", "grpo.vllm_enable_sleep_mode": "true",
                                         "data.eval": EVAL_PROMPTS, "eval.eval_steps": 2}))
    run = loop.Run(cfg, dp=Parallel())
    run.model.register_forward_pre_hook(on_forward)
    run.run()
    cycles = " ".join(events).replace("push", "|push").split("|")[1:]  # one per generation batch or eval
    assert len(cycles) >= 3 + 2 and all(re.fullmatch(r"push( generate)+ sleep ?", c) for c in cycles), events
    assert grad_passes_awake and not any(grad_passes_awake)
