"""Training losses. `dpo_loss` is imported on first use so this package stays light."""
from preftune.losses.grpo import grpo_loss
from preftune.losses.sft import sft_loss

__all__ = ["grpo_loss", "dpo_loss", "sft_loss"]


def __getattr__(name: str):
    if name == "dpo_loss":
        from preftune.losses.dpo import dpo_loss

        return dpo_loss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
