"""vLLM as the rollout engine (rollout/vllm.py), one engine for the module: pushed weights reach it
(full and LoRA-merged; under 2 FSDP2 ranks, each rank's own engine), its behaviour log-probs are
the trainer's sampling-distribution log-probs, its per-request seeds make sampling independent of
the batch, and a failure mid-run is an EngineError."""
from __future__ import annotations

import pytest
import torch

from preftune.data.tensors import left_pad
from preftune.losses.sampling import importance_weights
from preftune.model.logps import completion_logps
from preftune.rollout.sampler import sample
from preftune.rollout.vllm import EngineError, request_seed

PROMPTS = ["12+7=", "3+4=", "19+19=", "0+0=", "5+11=", "8+9="]


def _ids(tokenizer, prompts=PROMPTS):
    return [tokenizer(p).input_ids for p in prompts]


def _engine_greedy(engine, tokenizer, prompts=PROMPTS, new=6):
    return engine.generate(_ids(tokenizer, prompts), list(range(len(prompts))), num_generations=1,
                           max_new_tokens=new, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                           greedy=True)


def _own_greedy(model, tokenizer, prompts=PROMPTS, new=6):
    ids, mask = left_pad(_ids(tokenizer, prompts), tokenizer.pad_token_id)
    return sample(model, ids, mask, num_generations=1, max_new_tokens=new, eos_id=tokenizer.eos_token_id,
                  pad_id=tokenizer.pad_token_id, greedy=True)


def _completions(ro) -> list[list[int]]:
    return [row[:n] for row, n in zip(ro.completion_ids.tolist(), ro.completion_mask.sum(-1).tolist())]


def _train(model, tokenizer, steps: int = 4) -> None:
    """A few Adam steps towards completions the model does not give, so greedy decoding changes."""
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    ids, mask = left_pad(_ids(tokenizer), tokenizer.pad_token_id)
    target = torch.tensor([tokenizer("77").input_ids + [tokenizer.eos_token_id]] * len(PROMPTS))
    for _ in range(steps):
        logps, _ = completion_logps(model, ids, mask, target, torch.ones_like(target))
        opt.zero_grad()
        (-logps.sum()).backward()
        opt.step()


def test_pushed_weights_reach_the_engine(vllm_engine, model, tokenizer):
    vllm_engine.push(model)
    before = _completions(_engine_greedy(vllm_engine, tokenizer))
    assert before == _completions(_own_greedy(model, tokenizer))
    _train(model, tokenizer)
    after_own = _completions(_own_greedy(model, tokenizer))
    assert after_own != before  # the steps changed greedy decoding ...
    assert _completions(_engine_greedy(vllm_engine, tokenizer)) == before  # ... which the engine sees only
    seconds = vllm_engine.push(model)  # once the weights are pushed
    assert _completions(_engine_greedy(vllm_engine, tokenizer)) == after_own
    assert 0 < seconds < 60


def test_lora_is_merged_for_the_push(vllm_engine, tokenizer):
    from preftune.config import ModelConfig
    from preftune.config.schema import LoraConfig
    from preftune.model.load import load_model
    from tests.conftest import MODEL_DIR

    peft_model = load_model(ModelConfig(lora=LoraConfig(enabled=True, r=4)), str(MODEL_DIR))
    base = _completions(_own_greedy(peft_model, tokenizer))
    _train(peft_model, tokenizer, steps=6)  # only the adapters move
    tuned = _completions(_own_greedy(peft_model, tokenizer))
    assert tuned != base
    vllm_engine.push(peft_model)
    assert _completions(_engine_greedy(vllm_engine, tokenizer)) == tuned


def test_behaviour_logps_match_the_trainers(vllm_engine, model, tokenizer):
    """Float32, temperature 0.7, top_p 0.9, top_k 5: the engine's log-prob of each token it drew
    equals the trainer's for the same filtered distribution; the on-policy importance ratio is 1
    within 1%. The full softmax (what a trainer ignoring the filter computes) is off by more."""
    _train(model, tokenizer, steps=2)  # weights that are not the folder's
    vllm_engine.push(model)
    opts = dict(temperature=0.7, top_p=0.9, top_k=5)
    ro = vllm_engine.generate(_ids(tokenizer), list(range(len(PROMPTS))), num_generations=8, max_new_tokens=6,
                              eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, seed=3, **opts)
    mask = ro.completion_mask.float()
    with torch.no_grad():
        trainer, _ = completion_logps(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask,
                                      **opts)
        full, _ = completion_logps(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask,
                                   temperature=0.7)
    m = mask.bool()
    assert (trainer[m] - ro.sampling_logps[m]).abs().max() < 1e-3
    ratio = importance_weights(trainer, ro.sampling_logps, mask, mode="token_truncate", clip_max=None)
    assert ratio[m].mean().item() == pytest.approx(1.0, abs=0.01)
    drift = torch.exp(full - ro.sampling_logps)[m].mean().item()
    assert drift < 0.99, drift


def test_seeds_fix_each_completion_whatever_the_batch(vllm_engine, model, tokenizer):
    vllm_engine.push(model)

    def draw(prompts, positions, step=1):
        ro = vllm_engine.generate(_ids(tokenizer, prompts), positions, num_generations=4, max_new_tokens=6,
                                  eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, temperature=1.0,
                                  seed=0, step=step)
        return _completions(ro)

    full = draw(PROMPTS, list(range(6)))
    assert draw(PROMPTS, list(range(6))) == full  # the same requests, the same tokens
    assert draw(PROMPTS[3:], [3, 4, 5]) == full[12:]  # half of the batch (as on the second of 2 ranks)
    assert draw(PROMPTS, list(range(6)), step=2) != full  # another step, other draws
    assert len({request_seed(0, 1, 0, p, g) for p in range(6) for g in range(4)}) == 24


def say_ok() -> str:
    """Says ok."""
    return "ok"


class _ForcedFirstTurn:
    """An engine whose first turn is a fixed tool call (the tiny model writes none); later turns are
    the wrapped engine's, from token ids."""

    tp = 1

    def __init__(self, inner, forced: list[int]):
        self.inner, self.forced, self.with_logps = inner, forced, inner.with_logps

    def conversation(self):
        return self.inner.conversation()

    def generate(self, prompts, positions, *, turn=0, **kw):
        if turn:
            return self.inner.generate(prompts, positions, turn=turn, **kw)
        from preftune.rollout.sampler import assemble

        ids = torch.tensor([self.forced] * (len(prompts) * kw["num_generations"]))  # (N, T)
        return assemble(ids[:, :1], ids[:, :1], ids, kw["eos_id"])


def test_greedy_agent_rollouts_are_the_same_on_both_engines(vllm_engine, model, tokenizer):
    """The tool loop on vLLM and on the own sampler: the same tokens after a tool turn, the same masks.
    Before the tests that stop engines of their own (preftune eval), which tear down vLLM's
    process-wide parallel state that the module's engine samples with."""
    from transformers import AutoTokenizer

    from preftune.config import GRPOConfig
    from preftune.rollout.agent import ToolLoop, ToolTurns, Trajectory
    from preftune.rollout.engine import SamplerEngine
    from preftune.rollout.tools import make_tool
    from tests.conftest import MODEL_DIR
    from tests.rollout.test_agent import TEMPLATE

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    tok.chat_template = TEMPLATE
    vllm_engine.push(model)  # earlier tests pushed other weights
    forced = tok('{"name": "say_ok"}', add_special_tokens=False).input_ids + [tok.eos_token_id]
    cfg = GRPOConfig(max_completion_length=36)
    out = []
    for inner in (SamplerEngine(), vllm_engine):
        rows = [Trajectory(tokenizer(p).input_ids) for p in PROMPTS[:3] for _ in range(2)]
        loop = ToolLoop(tok, cfg, "llama3", ToolTurns(tok, None))
        ro = loop.run(_ForcedFirstTurn(inner, forced), rows, [{"say_ok": make_tool(say_ok, "t")}] * len(rows), 2,
                      [0, 1, 2], eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, greedy=True, model=model)
        assert all(r.turns >= 2 and r.calls >= 1 and r.failures == 0 for r in rows)
        out.append((ro.completion_ids.tolist(), ro.tool_mask.tolist(), ro.completion_mask.tolist()))
    assert out[0] == out[1]


def test_a_failure_while_sampling_is_an_engine_error(vllm_engine, tokenizer, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("engine core died")

    monkeypatch.setattr(vllm_engine.llm, "generate", broken)
    with pytest.raises(EngineError, match="engine core died"):
        _engine_greedy(vllm_engine, tokenizer)


def test_options_vllm_refuses_are_a_user_error_naming_the_key(vllm_engine):
    """A context longer than the model's positions: vLLM refuses it when the engine is built, which
    `preftune train` does before it writes anything (exit 78)."""
    from preftune.errors import UserError
    from preftune.rollout.vllm import VLLMEngine

    with pytest.raises(UserError, match="grpo.use_vllm.*max_model_len|max_model_len.*grpo.use_vllm") as info:
        VLLMEngine(vllm_engine.cfg, vllm_engine.model_cfg, max_model_len=4096, seed=0)
    assert "\n" not in str(info.value)


def test_preftune_eval_samples_with_an_engine_and_scores_as_the_own_sampler(vllm_engine, tmp_path):
    """`preftune eval ... grpo.use_vllm=true` starts an engine on each folder (a second and third
    engine in this process): its greedy figures equal the own sampler's."""
    import json
    import shutil

    from preftune.cli.command import main
    from tests.conftest import EXAMPLES, MODEL_DIR

    figures = {}
    for vllm in ("true", "false"):
        ckpt = tmp_path / f"ckpt-{vllm}"
        shutil.copytree(MODEL_DIR, ckpt)
        assert main(["eval", str(EXAMPLES / "grpo.yaml"), "--checkpoint", str(ckpt), "--baseline", str(MODEL_DIR),
                     f"grpo.use_vllm={vllm}", "eval.max_new_tokens=6"]) == 0
        figures[vllm] = json.loads((ckpt / "eval.json").read_text())
    assert figures["true"]["metrics"] == figures["false"]["metrics"]  # checkpoint's and baseline's figures
    assert figures["true"]["metrics"]["checkpoint"]["num_prompts"] == 100


def test_a_sharded_final_folder_loads_in_vllm(vllm_engine, model, tokenizer, tmp_path):
    """final/ as two FSDP2 ranks write it (two safetensors files and their index,
    distributed/weights.write_weights) is a folder vLLM loads: after a few steps away from the
    embedded weights, an engine started on it decodes greedily as the own module does."""
    from preftune.config import load_config
    from preftune.distributed.weights import write_weights
    from preftune.model.load import save_folder_files
    from preftune.rollout.vllm import VLLMEngine
    from tests.conftest import TRAIN_PROMPTS

    before = _completions(_own_greedy(model, tokenizer))
    _train(model, tokenizer)
    want = _completions(_own_greedy(model, tokenizer))
    assert want != before
    folder = tmp_path / "final"
    folder.mkdir()
    for rank in (0, 1):  # each rank's file, as the ranks write them
        write_weights(model, folder, torch.float32, rank=rank, world=2)
    save_folder_files(model, tokenizer, folder, dtype="float32")
    assert len(list(folder.glob("*.safetensors"))) == 2
    assert (folder / "model.safetensors.index.json").is_file()
    cfg = load_config(None, [f"model.name_or_path={folder}", f"data.train={TRAIN_PROMPTS}",
                             "grpo.use_vllm=true", "grpo.vllm_kv_cache_gib=1"])
    engine = VLLMEngine(cfg.grpo, cfg.model, max_model_len=64, seed=0)
    assert _completions(_engine_greedy(engine, tokenizer)) == want


def test_pushed_weights_reach_each_ranks_engine_under_fsdp2(tmp_path):
    """2 torchrun ranks (gloo), FSDP2 policy, an engine each (tests/distributed/vllm_greedy.py)."""
    import json
    import subprocess
    import sys

    from tests.distributed.ranks import ROOT, free_port, rank_env

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.distributed.vllm_greedy", str(tmp_path)], cwd=ROOT,
                              env=rank_env(r, 2, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for s in seen:
        assert s["before_engine"] == s["before_own"]
        assert s["after_own"] != s["before_own"]  # the steps changed greedy decoding ...
        assert s["stale_engine"] == s["before_own"]  # ... which the engine sees only once pushed
        assert s["after_engine"] == s["after_own"]
    assert seen[0]["after_own"] == seen[1]["after_own"]  # one policy, sharded
