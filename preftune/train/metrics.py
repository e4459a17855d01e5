"""metrics.jsonl (one JSON object per logged step), a progress bar, and optional TensorBoard events."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from preftune.train.startup import STARTUP_KEYS

TIMING_KEYS = ("step_time", "tokens_per_second", *STARTUP_KEYS)  # the only fields a resumed run may change


def _clean(v):
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None  # JSON has no NaN; null marks "not measured"
    return v


def truncate_after(path: Path, step: int) -> None:
    """Keep only records with step <= `step` (a resumed run rewrites what came after its checkpoint)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


class MetricsLog:
    def __init__(self, out_dir: Path, *, total_steps: int, start_step: int, progress: bool, tensorboard: bool):
        self.path = out_dir / "metrics.jsonl"
        truncate_after(self.path, start_step)
        self.file = open(self.path, "a")
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=max(start_step, 0), desc="train", dynamic_ncols=True)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                from preftune.errors import UserError

                raise UserError("log.report_to has tensorboard but it is not installed: "
                                "pip install 'preftune[tensorboard]'", where="log.report_to") from None
            # a resumed run rewrites the events after its checkpoint instead of duplicating them
            self.tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=start_step + 1 if start_step > 0 else None)

    def log(self, step: int, metrics: dict, *, advance: bool = False) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and v is not None and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.bar is not None:
            if advance:
                self.bar.update(1)
            show = {k: metrics[k] for k in ("reward", "loss", "kl", "eval/reward") if k in metrics}
            if show:
                self.bar.set_postfix({k: f"{v:.3f}" for k, v in show.items() if v is not None}, refresh=False)

    def close(self) -> None:
        self.file.close()
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
