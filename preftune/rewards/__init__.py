"""Reward functions (TRL's contract): `registry` loads and runs them, `builtin` holds the built-ins."""
