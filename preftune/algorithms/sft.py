"""The SFT task: completion-only negative log-likelihood on (prompt, completion) examples.

Examples come from labeled traces (rejection sampling: reward >= sft.min_reward), TRL's
prompt/completion columns or its conversational `messages` (`data/pipeline.py`). A micro-batch is
one pass of `model/logps.completion_logps`: one example per row, or (`sft.packing`) several packed
into a row with positions restarting per example and attention kept within each, when the
packer's rule says it is cheaper. Both layouts give the same loss (tested).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from preftune.config import Config
from preftune.data.pipeline import load_examples
from preftune.data.stream import IndexStream
from preftune.data.tokenize import PromptTruncation
from preftune.data.traces import TraceOptions
from preftune.data.turns import encode_set
from preftune.distributed.group import Parallel
from preftune.errors import UserError
from preftune.losses.sft import sft_loss
from preftune.model.logps import list_logps, microbatches
from preftune.algorithms.router import Routers, reduce_metrics


@dataclass
class SFTExample:
    prompt: list[int]
    completion: list[int]
    mask: list[int] | None = None  # per completion token, 1 where it trains (None: every token)

    def __len__(self) -> int:
        return len(self.prompt) + len(self.completion)

    @property
    def trained(self) -> int:
        """The completion tokens in the loss."""
        return len(self.completion) if self.mask is None else sum(self.mask)


def encode_examples(examples, tokenizer, cfg: Config) -> tuple[list[SFTExample], dict]:
    """Prompt under data.max_prompt_length's policy; the completion (+ EOS) cut to fit
    sft.max_length. A multi-turn completion trains its assistant turns only
    (`sft.assistant_only_loss`, `data/turns.py`)."""
    kept, counts = encode_set(
        tokenizer, ((e.prompt, [e.completion], e.tools) for e in examples),
        truncation=PromptTruncation(cfg.data.max_prompt_length, cfg.data.prompt_truncation),
        max_length=cfg.sft.max_length, tools_file=cfg.data.tools, model=cfg.model.name_or_path,
        assistant_only=cfg.sft.assistant_only_loss)
    out = [SFTExample(prompt, c.completion, c.mask) for _, prompt, (c,) in kept]
    return out, {"examples": len(out), **counts}


def example_logps(model, batch: list[SFTExample], pad_id: int, device, *, pack: bool = True):
    """Completion-token log-probs and entropies, flat (n,) in example order: one example per row, or
    several packed into a row where the packer's rule says so (`pack`; attention stays within
    each)."""
    logps, entropy, c_mask = list_logps(model, [e.prompt for e in batch],
                                        [e.completion for e in batch], pad_id,
                                        # (b, T)
                                        device, with_entropy=True, pack=pack,
                                        masks=[e.mask for e in batch])
    real = c_mask.bool()  # the trained tokens: not padding, not masked out (another turn's)
    return logps[real], entropy[real]  # row-major: example order


class SFTTask:
    """Builds everything and writes nothing: the loop writes `data_report` once setup has
    succeeded."""

    engine = agent = None  # evaluation samples with the own sampler, through grpo.tools if any

    def __init__(self, cfg: Config, model, tokenizer, device: torch.device, dp: Parallel):
        self.cfg, self.s, self.device, self.dp = cfg, cfg.sft, device, dp
        examples, report = load_examples(cfg.data.train,
                                         TraceOptions.from_config(cfg.data), self.s.min_reward,
                                         split=cfg.eval.split)
        self.encoded, stats = encode_examples(examples, tokenizer, cfg)
        self.data_report = report | {"encoded": stats}
        if not self.encoded:
            raise UserError("no SFT example left after tokenisation (prompts dropped by "
                            "data.prompt_truncation: "
                            f"{stats['prompts_dropped']})", where=cfg.data.train)
        self.pad_id = tokenizer.pad_token_id
        self.stream = IndexStream(len(self.encoded), cfg.seed, cfg.data.shuffle)
        self.routers = Routers.of(model, cfg.model.router_aux_loss_coef)

    def prepare(self, model) -> None:
        """Nothing to compute from the initial weights."""

    def evaluator(self) -> None:
        """The run's held-out prompts."""

    def logps(self, model, batch: list[SFTExample]):
        return example_logps(model, batch, self.pad_id, self.device, pack=self.s.packing)

    def step(self, model, step: int, stop) -> dict:
        batch = [self.encoded[i] for i in self.stream.take(self.s.batch_size)]  # the global batch
        # n_items: the whole step's loss normaliser (>= 1: a cut agent row can keep only masked
        # tokens)
        B, n_items = len(batch), max(sum(e.trained for e in batch), 1)
        # this rank's share (all of it in one process)
        mine = batch[self.dp.even_share(B, "sft.batch_size")]
        loss_sum = entropy_sum = 0.0
        for sl in microbatches(len(mine), self.s.micro_batch_size):
            stop.check()
            logps, entropy = self.logps(model, mine[sl])  # (n,), (n,)
            loss = sft_loss(logps, torch.ones_like(logps), n_items)
            if self.routers is not None:
                loss = self.routers.added(loss, (sl.stop - sl.start) / B)
            # normalised by the step's token count: micro-batches and ranks add up exactly
            loss.backward()
            loss_sum += loss.item()
            entropy_sum += entropy.sum().item()
        # partial sums of this rank's share, added up over the ranks
        return reduce_metrics(
            self.dp,
            {
                "loss": loss_sum,
                "entropy": entropy_sum / n_items,
                "completions/mean_length": sum(len(e.completion) for e in mine) / B,
                "num_tokens": sum(len(e) for e in mine),
            },
            self.routers,
        )

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
