"""preftune: preference and reward fine-tuning for language models."""
__version__ = "0.1.0"
