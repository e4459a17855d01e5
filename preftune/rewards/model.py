"""Reward models as reward functions: a local Hugging Face sequence-classification folder (one
label) named in grpo.reward_funcs or eval.reward_funcs scores each completion with its logit, as TRL
1.16's GRPOTrainer does with a reward model in `reward_funcs`.

The text it scores is prompt + completion for text prompts, or the chat template of the whole
conversation (prompt messages + the assistant's completion) for chat prompts, tokenised by the
model's own tokenizer without special tokens and padded on the right (TRL's rule). Each process
loads a folder once, on the policy's device, and scores only its own rows (a rank scores the
completions it sampled) in batches of `grpo.reward_model_batch_size`, without gradients.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from preftune.data.messages import is_messages
from preftune.errors import UserError, one_line
from preftune.model.load import hf_quiet, load_tokenizer, weights_signature

# (folder, device, weights) -> loaded model: one load per process
_LOADED: dict[tuple, "RewardModel"] = {}


def is_model_folder(spec: str, base_dir: str | Path = ".") -> Path | None:
    """The folder a reward spec names (absolute, or relative to `base_dir` or the working
    directory), or None."""
    for path in (Path(spec).expanduser(), Path(base_dir) / spec):
        if path.is_dir():
            return path.resolve()
    return None


def _check_folder(folder: Path, where: str) -> None:
    """A sequence-classification model with one label (its logit is the reward), else a UserError
    naming it."""
    config = folder / "config.json"
    if not config.is_file():
        raise UserError(f"{folder} is a folder without config.json: not a Hugging Face "
                        "sequence-classification model (a reward model)", where=where)
    try:
        meta = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {config}: {one_line(e)}", where=where) from None
    archs = meta.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        names = ", ".join(map(str, archs)) or "none"
        raise UserError(f"{folder} is not a sequence-classification model "
                        f"(architectures: {names}); a reward model is a "
                        "*ForSequenceClassification checkpoint with one label", where=where)
    labels = (
        len(meta["id2label"])
        if isinstance(meta.get("id2label"), dict)
        else meta.get("num_labels", 2)
    )
    if labels != 1:
        raise UserError(f"{folder} has {labels} labels; a reward "
                        "model has one (its logit is the reward)", where=where)
    if not any(f.endswith((".safetensors", ".bin")) for f in os.listdir(folder)):
        raise UserError(f"{folder} has no weights (*.safetensors or *.bin)", where=where)


class RewardModel:
    """A reward function (TRL's contract) backed by a sequence-classification model."""

    def __init__(self, folder: Path, *, device, batch_size: int, where: str):
        from transformers import AutoModelForSequenceClassification

        hf_quiet()
        _check_folder(folder, where)
        try:
            self.tokenizer = load_tokenizer(str(folder), own=False)  # batches with padding
        except UserError as e:
            raise UserError(f"{folder}: {e.message}", where=where) from None
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(str(folder),
                                                                            dtype="auto")
        except Exception as e:  # noqa: BLE001 - a broken folder is the user's, whatever transformers raises
            raise UserError(
                f"cannot load {folder}: {one_line(e, with_type=True)}", where=where
            ) from None
        # the model pools the last token that is not padding: it must know the tokenizer's pad id
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(device).eval().requires_grad_(False)
        self.device, self.batch_size = torch.device(device), batch_size
        # the metric is rewards/<folder name>/mean, TRL's model-id basename
        self.__name__ = folder.name

    def texts(self, prompts: list, completions: list) -> list[str]:
        """prompt + completion, or the chat template of the whole conversation for chat prompts."""
        if prompts and is_messages(prompts[0]):
            return [self.tokenizer.apply_chat_template(list(p) + list(c), tokenize=False)
                    for p, c in zip(prompts, completions)]
        return [str(p) + str(c) for p, c in zip(prompts, completions)]

    @torch.inference_mode()
    def __call__(self, prompts: list, completions: list, **_) -> list[float]:
        texts, scores = self.texts(prompts, completions), []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[start:start + self.batch_size],
                                 return_tensors="pt", padding=True,
                                 padding_side="right", add_special_tokens=False)
            enc = {k: v.to(self.device) for k, v in enc.items()}
            # (b,) one label: the reward
            scores += self.model(**enc).logits[:, 0].float().cpu().tolist()
        return scores


def load_reward_model(folder: Path, *, device, batch_size: int, where: str) -> RewardModel:
    """The folder's reward model on `device`, loaded once per process (and again if its weights
    change)."""
    key = (str(folder), str(torch.device(device)), weights_signature(str(folder)))
    if key not in _LOADED:
        _LOADED[key] = RewardModel(folder, device=device, batch_size=batch_size, where=where)
    model = _LOADED[key]
    model.batch_size = batch_size
    return model
