"""After training: statistics of held-out results, the promotion gate, the model registry, `preftune
eval`."""
