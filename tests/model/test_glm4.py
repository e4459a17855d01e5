"""GLM-4 in the own module, beyond the per-architecture equality tests it shares with the Llama
family (tests/model/test_llama.py, test_logps.py, tests/distributed/test_layouts.py): the
interleaved partial rotary by hand, folders in and out, the dispatch and its log line, activation
checkpointing, and a GRPO run that trains, checkpoints and saves a GLM-4 folder."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch

from preftune.model import ops
from preftune.model.families import own_class, unsupported
from preftune.model.glm4 import Glm4
from tests.conftest import MODEL_DIR
from tests.model.test_llama import VOCAB, grads, pair, tiny


def test_rotate_pairs_by_hand():
    """Channels (0, 1) turn by angle 0's, (2, 3) by angle 1's; channels past r pass unchanged."""
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]], dtype=torch.float64)  # (1, h=1, d=6)
    angles = torch.tensor([0.5, 1.25], dtype=torch.float64)
    cos, sin = torch.cat([angles, angles]).cos()[None, None], torch.cat([angles, angles]).sin()[None, None]  # r = 4
    c, s = angles.cos(), angles.sin()
    want = [1 * c[0] - 2 * s[0], 2 * c[0] + 1 * s[0], 3 * c[1] - 4 * s[1], 4 * c[1] + 3 * s[1], 5.0, 6.0]
    torch.testing.assert_close(ops.rotate_pairs(x, cos, sin)[0, 0], torch.stack([torch.as_tensor(v) for v in want]))


def _folder(tmp_path, dtype=torch.float32, **kw):
    """A tiny random GLM-4 saved as a Hugging Face folder, with the example tokenizer."""
    hf = tiny("glm4", dtype=dtype, head_dim=8, **kw)
    hf.save_pretrained(tmp_path / "glm")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / name, tmp_path / "glm" / name)
    return hf, tmp_path / "glm"


def test_a_glm4_folder_loads_as_the_own_module_and_saves_what_transformers_opens(tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    from preftune.config import ModelConfig
    from preftune.model import load

    hf, folder = _folder(tmp_path)
    load._SAID.clear()
    with caplog.at_level(logging.INFO, logger="preftune.model.load"):
        own = load.load_model(ModelConfig(), str(folder))
        load.load_model(ModelConfig(), str(folder), trainable=False)  # the reference: said once
        load.load_model(ModelConfig(lean_forward=False), str(folder))
    said = [r.getMessage() for r in caplog.records if "runs on" in r.getMessage()]
    assert said == ["model glm4 runs on preftune's own module (Glm4)",
                    "model glm4 runs on the Hugging Face module (model.lean_forward: false)"]
    assert isinstance(own, Glm4)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        torch.testing.assert_close(own.logits(own.hidden(ids, pos)), want, rtol=0, atol=1e-5)
        own.model.layers[1].post_mlp_layernorm.weight.mul_(1.5)  # changed, so the copy is the own module's
        own.save_pretrained(tmp_path / "out")
        again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
        torch.testing.assert_close(again(input_ids=ids).logits, own.logits(own.hidden(ids, pos)), rtol=0, atol=1e-5)
    assert type(again).__name__ == "Glm4ForCausalLM"


@pytest.mark.parametrize("kw", [{"hidden_act": "gelu"}, {"attention_dropout": 0.1},
                                {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}])
def test_what_glm4_leaves_to_the_hugging_face_module(kw):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("glm4", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, **kw)
    assert unsupported(cfg) and own_class(cfg) is None


def test_activation_checkpointing_gives_the_same_gradients():
    _, own = pair("glm4")
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(7).expand(2, 7)
    out = []
    for flag in (False, True):
        own.checkpointing = flag
        own.logits(own.hidden(ids, pos)).square().sum().backward()
        out.append(grads(own))
    assert out[0].keys() == out[1].keys()
    for k in out[0]:
        torch.testing.assert_close(out[1][k], out[0][k], rtol=0, atol=1e-12)


def test_grpo_trains_a_glm4_model_and_saves_its_folder(tmp_path):
    """Online GRPO end to end on the own GLM-4 module: the own sampler, the training pass, a
    checkpoint, and a final folder that transformers opens as Glm4ForCausalLM."""
    import preftune
    from transformers import AutoModelForCausalLM

    from tests.test_api import PROMPTS, brevity, overrides

    _, folder = _folder(tmp_path)
    result = preftune.train({}, overrides=overrides(tmp_path, **{"model.name_or_path": str(folder), "save_steps": 1}),
                            reward_funcs=[brevity], train_data=PROMPTS)
    assert result.step == 2 and (tmp_path / "run" / "checkpoints").is_dir()
    final = AutoModelForCausalLM.from_pretrained(str(result.model_path))
    assert type(final).__name__ == "Glm4ForCausalLM"
    start = AutoModelForCausalLM.from_pretrained(str(folder))
    assert any(not torch.equal(a, b) for a, b in zip(final.state_dict().values(), start.state_dict().values()))
