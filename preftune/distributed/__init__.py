"""Data parallelism, the only code that calls torch.distributed: the process group and its
collectives (`group.py`), FSDP2 / DDP applied to a model from outside (`fsdp.py`), a model's
weights read into its shards and written from them one tensor at a time (`weights.py`). The sharded
checkpoint format is the checkpointer's (`run/shards.py`); streaming whole weights to a rollout
engine is the engines' (`rollout/weights.py`).

Strategies (`distributed.strategy`):
  fsdp  FSDP2: `fully_shard` on each decoder block, then the root; parameters, gradients and
        optimizer state sharded over the ranks; bf16 compute with fp32 reduction for
        model.dtype=bfloat16.
  ddp   every rank holds the whole model; gradients are summed with one all-reduce per step
        (after all micro-batches, as DDP's no_sync does), so uneven micro-batch counts cannot hang.
  none  one process only.
Gradients are *summed* over ranks: each rank's loss is already weighted by the global batch's
normalisers (sequences, tokens), so the sum is the gradient of one pass over the global batch.
"""
