"""config.json read without transformers (model/hf_config.py) against transformers' own reading:
every key the own module reads, for each family, as transformers 5 saves the file and as older
files leave keys out; what it leaves to transformers; and a model built from either config is the
same model."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from preftune.model import hf_config
from preftune.model.families import own_class
from tests.conftest import MODEL_DIR, ROOT
from tests.model.test_llama import ARCHS, tiny

# what the own module and the run read from a model's config
READ = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings",
        "attention_bias", "mlp_bias", "hidden_act", "attention_dropout", "use_sliding_window",
        "sliding_window", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "output_router_logits",
        "router_aux_loss_coef", "pad_token_id", "eos_token_id")
MISSING = object()


def same_reading(folder):
    from transformers import AutoConfig

    want, got = AutoConfig.from_pretrained(folder), hf_config.read(folder)
    assert got is not None
    for key in READ:
        assert getattr(got, key, MISSING) == getattr(want, key, MISSING), key
    head_dim = getattr(want, "head_dim", None) or want.hidden_size // want.num_attention_heads
    assert (getattr(got, "head_dim", None) or got.hidden_size // got.num_attention_heads) == head_dim
    assert got.rope_parameters == want.rope_parameters
    return want, got


PLAIN = [a for a in ARCHS if a != "llama-yarn"]


@pytest.mark.parametrize("arch", PLAIN)
def test_a_saved_config_reads_as_transformers_reads_it(tmp_path, arch):
    hf = tiny(ARCHS[arch][0], dtype=torch.float32, **ARCHS[arch][1])
    hf.config.save_pretrained(tmp_path)
    want, got = same_reading(tmp_path)
    with torch.device("meta"):  # the same parameters, names and shapes
        a, b = own_class(want)(want), own_class(got)(got)
    assert {n: p.shape for n, p in a.named_parameters()} == {n: p.shape for n, p in b.named_parameters()}


@pytest.mark.parametrize("arch", PLAIN)
def test_an_older_file_with_keys_left_out_reads_the_same(tmp_path, arch):
    """What a hub folder of an older transformers holds: rope_theta at the top, no rope_parameters,
    and the optional keys left to their defaults."""
    hf = tiny(ARCHS[arch][0], dtype=torch.float32, **ARCHS[arch][1])
    values = hf.config.to_dict()
    rope = values.pop("rope_parameters")
    values["rope_theta"] = rope["rope_theta"]
    for key, default in hf_config.DEFAULTS[values["model_type"]].items():
        if values.get(key) == default and key != "rope_theta":
            values.pop(key)
    if "partial_rotary_factor" in rope and rope["partial_rotary_factor"] != 0.5:
        values["partial_rotary_factor"] = rope["partial_rotary_factor"]
    (tmp_path / "config.json").write_text(json.dumps(values))
    same_reading(tmp_path)


def test_the_defaults_are_transformers_defaults():
    from transformers import AutoConfig

    for model_type, defaults in hf_config.DEFAULTS.items():
        want = AutoConfig.for_model(model_type, hidden_size=64, num_attention_heads=4)
        for key, value in defaults.items():
            seen = want.rope_parameters.get(key) if key in ("rope_theta", "partial_rotary_factor") \
                else getattr(want, key)
            assert seen == value, (model_type, key)


def test_what_it_leaves_to_transformers(tmp_path):
    values = json.loads((MODEL_DIR / "config.json").read_text())
    cases = {
        "a rotary table of its own": values | {"rope_parameters": {"rope_type": "yarn", "factor": 2.0,
                                                                   "rope_theta": 1e4}},
        "old-style scaling": values | {"rope_scaling": {"type": "linear", "factor": 2.0}},
        "another model type": values | {"model_type": "gpt2"},
        "its own code": values | {"auto_map": {"AutoModelForCausalLM": "m.M"}},
        "no key-value heads": {k: v for k, v in values.items() if k != "num_key_value_heads"},
    }
    for why, case in cases.items():
        (tmp_path / "config.json").write_text(json.dumps(case))
        assert hf_config.read(tmp_path) is None, why


def test_the_embedded_model_runs_without_importing_transformers(tmp_path):
    """A run's model and tokenizer, loaded in a fresh process, import no transformers."""
    code = ("import sys\nfrom preftune.config import ModelConfig\n"
            "from preftune.model.load import load_model, load_tokenizer\n"
            f"m = load_model(ModelConfig(), {str(MODEL_DIR)!r})\n"
            f"t = load_tokenizer({str(MODEL_DIR)!r})\n"
            f"m.save_pretrained({str(tmp_path / 'out')!r})\n"
            "print(type(m).__name__, 'transformers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["Llama", "False"]
    from transformers import AutoConfig

    saved, source = (AutoConfig.from_pretrained(p).to_dict() for p in (tmp_path / "out", MODEL_DIR))
    assert saved | {"_name_or_path": ""} == source | {"dtype": "float32", "_name_or_path": ""}
