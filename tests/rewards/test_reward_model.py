"""Reward models as reward functions: a tiny sequence-classification folder built here scores like
TRL 1.16's GRPOTrainer (text and chat prompts), in batches, loaded once; online GRPO and evaluation log
rewards/<name>/mean; a rank scores only its own rows; a folder that is not a reward model exits 78 naming it."""
from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from preftune.errors import EXIT_USER, UserError
from preftune.rewards.functions import compute_rewards, load_reward_function, load_reward_funcs
from preftune.distributed.group import Parallel
from tests.conftest import MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PROMPTS = ["12+7=", "3+4=", "19+19="]
COMPLETIONS = ["19", "8 and more", ""]


def make_reward_model(folder: Path, *, num_labels: int = 1, seed: int = 0) -> Path:
    """A sequence-classification model on the embedded model's config (random weights, seeded) and its tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(MODEL_DIR, num_labels=num_labels)
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(MODEL_DIR / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    return make_reward_model(tmp_path_factory.mktemp("models") / "tiny-rm")


def _trl_rewards(folder: Path, prompts: list, completions: list) -> torch.Tensor:
    """TRL 1.16's GRPOTrainer._calculate_rewards with the folder as its one reward model, on a trainer
    built without __init__; the reward model and its tokenizer prepared as GRPOTrainer.__init__ does."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import GRPOTrainer

    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.config.get_text_config().pad_token_id = tok.pad_token_id
    t = object.__new__(GRPOTrainer)
    t.__dict__.update(accelerator=SimpleNamespace(device="cpu", is_main_process=True), is_deepspeed_enabled=False,
                      args=SimpleNamespace(device="cpu", report_to=[]), state=SimpleNamespace(global_step=0),
                      reward_funcs=[model], reward_processing_classes=[tok], reward_func_names=[folder.name],
                      environments=None, chat_template_kwargs={}, _pending_extra_logs={}, _pending_metrics={})
    inputs = [{"prompt": p} for p in prompts]
    return GRPOTrainer._calculate_rewards(t, inputs, prompts, completions, [[1]] * len(prompts))[:, 0]


def test_scores_text_prompts_like_trl(rm_dir):
    pytest.importorskip("trl")
    func = load_reward_function(str(rm_dir), reward_model_batch_size=2)  # batches of 2 and 1
    ours = torch.tensor(func(prompts=PROMPTS, completions=COMPLETIONS))
    theirs = _trl_rewards(rm_dir, PROMPTS, COMPLETIONS)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert ours.std() > 0  # different texts, different scores: the comparison is not vacuous


def test_scores_chat_prompts_like_trl(rm_dir):
    pytest.importorskip("trl")
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    func = load_reward_function(str(rm_dir))
    ours = torch.tensor(func(prompts=prompts, completions=completions))
    torch.testing.assert_close(ours, _trl_rewards(rm_dir, prompts, completions), rtol=1e-5, atol=1e-6)
    assert func.texts(prompts, completions)[0] == "12+7=19<eos>"  # the chat template of the conversation


def test_batching_and_padding_do_not_change_a_score(rm_dir):
    from transformers import AutoModelForSequenceClassification

    func = load_reward_function(str(rm_dir), reward_model_batch_size=1)
    one = func(prompts=PROMPTS, completions=COMPLETIONS)
    func.batch_size = 64
    torch.testing.assert_close(torch.tensor(func(prompts=PROMPTS, completions=COMPLETIONS)), torch.tensor(one),
                               rtol=1e-5, atol=1e-6)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    ids = func.tokenizer("19+19=", add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        assert model(input_ids=ids).logits[0, 0].item() == pytest.approx(one[2], abs=1e-5)


def test_loaded_once_on_the_policys_device_without_gradients(rm_dir, monkeypatch):
    from transformers import AutoModelForSequenceClassification

    from preftune.config import GRPOConfig
    from preftune.rewards import model as rm

    monkeypatch.setattr(rm, "_LOADED", {})
    loads = []
    real = AutoModelForSequenceClassification.from_pretrained
    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained",
                        lambda *a, **k: loads.append(a) or real(*a, **k))
    cfg = GRPOConfig(reward_model_batch_size=3)
    train = load_reward_funcs([str(rm_dir), "accuracy"], cfg, device=torch.device("cpu"))
    evaluation = load_reward_funcs([str(rm_dir)], cfg, device="cpu")
    assert len(loads) == 1 and evaluation[0] is train[0] and train[0].batch_size == 3
    assert all(not p.requires_grad and p.device.type == "cpu" for p in train[0].model.parameters())
    res = compute_rewards(train, PROMPTS, COMPLETIONS, [[1]] * 3, {"answer": ["19", "7", "38"]})
    assert res.names == ["tiny-rm", "accuracy"]
    with torch.enable_grad():
        assert not torch.tensor(train[0](prompts=PROMPTS, completions=COMPLETIONS)).requires_grad


@pytest.mark.parametrize("kind", ["no config", "causal LM", "two labels", "missing"])
def test_a_folder_that_is_not_a_reward_model_is_a_user_error(kind, tmp_path):
    folder = tmp_path / "rm"
    if kind == "no config":
        folder.mkdir()
        (folder / "notes.txt").write_text("x")
    elif kind == "causal LM":
        shutil.copytree(MODEL_DIR, folder)
    elif kind == "two labels":
        make_reward_model(folder, num_labels=2)
    spec = str(folder) if kind != "missing" else "./no/such/rm"
    match = {"no config": "without config.json", "causal LM": "architectures: Qwen2ForCausalLM",
             "two labels": "has 2 labels", "missing": "no such reward-model folder"}[kind]
    with pytest.raises(UserError, match=match) as info:
        load_reward_function(spec)
    assert info.value.where == f"reward '{spec}'"


def test_cli_exit_78_naming_the_folder(make_config, tmp_path, capsys):
    from preftune.cli.command import main

    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("{}\n")
    out = tmp_path / "out"
    code = main(["train", str(run_yaml), f"output_dir={out}", f"model.name_or_path={MODEL_DIR}",
                 f"data.train={MODEL_DIR.parent / 'data' / 'train_prompts.jsonl'}", f"grpo.reward_funcs=[{MODEL_DIR}]",
                 "max_steps=1", "log.progress_bar=false"])
    err = capsys.readouterr().err
    assert code == EXIT_USER and f"reward '{MODEL_DIR}'" in err and "not a sequence-classification model" in err
    assert "Traceback" not in err and not out.exists()


def test_online_grpo_and_eval_log_the_reward_model(make_config, rm_dir, model, tokenizer):
    from preftune.algorithms.grpo import GRPOTask
    from preftune.evaluation.evaluate import build_evaluator
    from tests.conftest import EVAL_PROMPTS

    cfg = make_config(f"grpo.reward_funcs=[{rm_dir}, length]", f"data.eval={EVAL_PROMPTS}", "eval.batch_size=8")
    task = GRPOTask(cfg, model, tokenizer, torch.device("cpu"), dp=Parallel())

    class _Stop:
        def check(self):
            pass

    m = task.step(model, 1, _Stop())
    assert "rewards/tiny-rm/mean" in m and "rewards/length/mean" in m and m["reward_std"] > 0
    ev = build_evaluator(cfg, tokenizer)(model, 0)
    assert "eval/rewards/tiny-rm/mean" in ev and ev["eval/num_prompts"] == 100


def test_each_rank_scores_only_its_own_rows(rm_dir, model, tokenizer):
    """Rank 1 of 2 samples its share of the prompts and the reward model scores those rows only."""
    from preftune.config import GRPOConfig
    from preftune.data.prompts import PromptSet
    from preftune.data.tokenize import PromptTruncation
    from preftune.distributed.group import Parallel
    from preftune.rollout.online import OnlineSource

    func = load_reward_function(str(rm_dir))
    scored = []

    def counting(prompts, completions, **kw):
        scored.extend(prompts)
        return func(prompts=prompts, completions=completions)

    cfg = GRPOConfig(num_generations=2, max_completion_length=2, prompts_per_step=4)
    prompts = PromptSet([f"{i}+{i}=" for i in range(8)], {})
    src = OnlineSource(cfg, tokenizer, prompts, [counting], seed=0, shuffle=False, truncation=PromptTruncation(16),
                       device=torch.device("cpu"), dp=Parallel(rank=1, world=2))
    s = src.make_batch(model, step=1)
    assert scored == ["2+2=", "2+2=", "3+3=", "3+3="] and s.total.numel() == 4


def test_a_folder_beside_the_config_is_resolved(rm_dir, tmp_path, monkeypatch):
    from preftune.config import load_config

    shutil.copytree(rm_dir, tmp_path / "cfg" / "rm")
    (tmp_path / "cfg" / "run.yaml").write_text("grpo:\n  reward_funcs: [./rm, accuracy]\neval:\n  reward_funcs: [./rm]\n")
    monkeypatch.chdir(tmp_path)  # not the config's folder
    cfg = load_config(tmp_path / "cfg" / "run.yaml", ["data.train=x.jsonl"])
    rm = str((tmp_path / "cfg" / "rm").resolve())
    assert cfg.grpo.reward_funcs == [rm, "accuracy"] and cfg.eval.reward_funcs == [rm]
