"""`preftune.model.load`: `to_device` (host values to the training device; on CPU, a plain copy) and
`load_model` without weights (the module FSDP2 ranks build on the meta device)."""
import torch

from preftune.model.load import to_device


def test_to_device_takes_lists_and_tensors():
    got = to_device([1, 2, 3], "cpu", torch.long)
    assert got.dtype == torch.long and got.tolist() == [1, 2, 3] and got.device.type == "cpu"
    t = torch.arange(4.0)
    assert to_device(t, torch.device("cpu")) is t  # already there: no copy
    assert to_device([[0.5]], "cpu").dtype == torch.float32


def test_a_model_without_weights_is_the_same_module_on_the_meta_device():
    """`load_model(weights=False)` reads config.json only: the same parameter and buffer names,
    shapes, dtypes, tied weights and flags as the loaded model, with no storage."""
    from preftune.config import ModelConfig
    from preftune.model.load import load_model
    from tests.conftest import MODEL_DIR

    for cfg, trainable in ((ModelConfig(), True), (ModelConfig(dtype="bfloat16"), True),
                           (ModelConfig(dtype="bfloat16"), False)):
        real = load_model(cfg, str(MODEL_DIR), trainable=trainable)
        meta = load_model(cfg, str(MODEL_DIR), trainable=trainable, weights=False)
        for named in ("named_parameters", "named_buffers"):
            want = {n: (t.shape, t.dtype, t.requires_grad) for n, t in getattr(real, named)()}
            got = {n: (t.shape, t.dtype, t.requires_grad) for n, t in getattr(meta, named)()}
            assert got == want, named
        assert all(t.is_meta for t in meta.parameters()) and all(t.is_meta for t in meta.buffers())
        assert meta.training == real.training and type(meta) is type(real)
        assert meta.autocast_dtype == real.autocast_dtype
        tied = real.config.tie_word_embeddings
        assert (meta.lm_head.weight is meta.model.embed_tokens.weight) == tied


def test_transformers_is_quiet_while_a_run_loads_and_as_before_after():
    """Its bars and warnings would bury the run's; a user's settings come back when the run ends."""
    from transformers.utils import logging as hf_logging

    from preftune.config import ModelConfig
    from preftune.model.load import load_model, quiet_transformers
    from tests.conftest import MODEL_DIR

    hf_logging.set_verbosity_info()
    hf_logging.enable_progress_bar()
    try:
        with quiet_transformers():
            load_model(ModelConfig(lean_forward=False), str(MODEL_DIR))
            assert hf_logging.get_verbosity() == hf_logging.ERROR and not hf_logging.is_progress_bar_enabled()
        assert hf_logging.get_verbosity() == hf_logging.INFO and hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.set_verbosity_warning()
