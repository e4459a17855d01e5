#!/usr/bin/env bash
# FSDP2 on this machine's device, one rank under torchrun: every rank builds the model on the meta device,
# shards it, allocates its shards (to_empty) and reads its own slices of the weights (fsdp.load), then
# 3 GRPO steps with a reference model (beta 0.04), gathered generation and a final/ written sharded. On a GPU
# this is the only run of that path under CUDA and NCCL; bench/gpu.sh runs it (FSDP=0 skips it).
#
#   bash bench/fsdp_check.sh OUT_FOLDER      # the run's folder; its output also goes to OUT_FOLDER.log
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: bash bench/fsdp_check.sh OUT_FOLDER}"
PY="${PYTHON:-python3}"
mkdir -p "$(dirname "$OUT")"
"$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m preftune train examples/grpo.yaml \
  distributed.strategy=fsdp grpo.beta=0.04 max_steps=3 save_steps=0 log.progress_bar=false \
  output_dir="$OUT" resume=never overwrite_output_dir=true 2>&1 | tee "$OUT.log"
grep -E "backend|each rank read its own slices" "$OUT.log" || true
if ! grep -q "each rank read its own slices" "$OUT.log"; then
  echo "FSDP check: the ranks did not read their own slices of the weights" >&2
  exit 1
fi
echo "FSDP check passed: $OUT"
