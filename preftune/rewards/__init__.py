"""Reward functions (TRL's contract): `registry` loads and runs them, `builtin` holds the
built-ins."""

# The name a Python reward function handed to preftune.train() stands under in a config; here (no
# torch) so the resume and completion checks can read configs without importing the registry.
CALLABLE_PREFIX = "callable:"
