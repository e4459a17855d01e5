#!/usr/bin/env bash
# The one prepared command for a session with a GPU (bench/README.md, "GPU"): the suite's 0.5B rows in bf16,
# preftune and TRL, on this machine's GPU, with nothing fetched from the network. From the repo root:
#
#   bash bench/gpu.sh                     # = bench/gpu_decode.py, bench/fsdp_check.sh, then bench/suite.py --size gpu
#   bash bench/gpu.sh --size quick        # other suite options replace `--size gpu`
#   DECODE=0 FSDP=0 SUITE=0 bash bench/gpu.sh   # only the vLLM rows (a second device command)
#
# Wheels the machine lacks (bench/gpu_wheels.sh, carried in .whl/) are installed into /tmp/site first.
# Writes $OUT/gpu-decode.json (DECODE=0 skips that run), $OUT/fsdp-check{,.log} (FSDP=0 skips it),
# $OUT/bench-vllm.json and $OUT/bench-gpu-vllm.json (VLLM=0 skips both), $OUT/bench-gpu.json (SUITE=0 skips it;
# rewritten after each row) and $OUT/bench-gpu.log (all of this script's output); OUT defaults to ./bench-gpu-out. Exits non-zero
# when an import, a check or a run fails.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/bench-gpu-out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
# No network there: the HF libraries must not wait on the hub. Expandable segments spare both frameworks
# out-of-memory failures from fragmentation (it changes what is reserved, not max_memory_allocated).
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
export PYTHONUNBUFFERED=1

install_wheels() {
  compgen -G ".whl/*.whl" >/dev/null || { echo "== no .whl/ wheels: using what is installed"; return 0; }
  echo "== installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into /tmp/site"
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  else  # no pip: these wheels are pure Python, and a pure-Python wheel installs by unpacking it
    "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall("/tmp/site") for w in sys.argv[1:]]' .whl/*.whl
  fi
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
}

check_imports() {
  "$PY" - <<'PYEOF'
import importlib, sys
failed = []
for name in ("preftune", "datasets", "trl", "accelerate"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')} from {mod.__file__}")
    except Exception as e:  # noqa: BLE001 - any failure to import is the message to show
        failed.append(f"{name}: {type(e).__name__}: {e}")
if not failed:
    try:  # TRL imports its trainers lazily: a missing dependency shows only here
        from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer  # noqa: F401
    except Exception as e:  # noqa: BLE001
        failed.append(f"trl trainers: {type(e).__name__}: {e}")
if failed:
    print("cannot run the benchmark, imports failed:\n  " + "\n  ".join(failed), file=sys.stderr)
    print("fetch the missing wheels with `bash bench/gpu_wheels.sh` and carry .whl/ with the run", file=sys.stderr)
    sys.exit(1)
PYEOF
}

main() {
  echo "== $(date -u +%FT%TZ) $(hostname) in $PWD, output in $OUT"
  nvidia-smi || echo "(no nvidia-smi)"
  "$PY" -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__,
    "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "transformers", transformers.__version__)'
  install_wheels
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  check_imports
  [ $# -gt 0 ] || set -- --size gpu
  local cache=/tmp/preftune-bench-models  # the 0.5B model is built once, for the suite and the decode bench
  local rc=0
  # first the own module against the HF one on the GPU (bench/gpu_decode.py, about a minute; DECODE=0 skips
  # it): decoding, and a training pass eager and with per-block torch.compile; it builds the model the suite reuses
  if [ "${DECODE:-1}" != 0 ]; then
    echo "== $PY bench/gpu_decode.py --json $OUT/gpu-decode.json --model-cache $cache"
    timeout "${DECODE_TIMEOUT:-180}" "$PY" bench/gpu_decode.py --json "$OUT/gpu-decode.json" --model-cache "$cache" \
      || rc=$?
  fi
  # then FSDP2 under CUDA/NCCL (bench/fsdp_check.sh, one rank, the tiny model; FSDP=0 skips it): the meta-device
  # build and rank 0's weights broadcast have run only on CPU with gloo
  if [ "${FSDP:-1}" != 0 ]; then
    echo "== bash bench/fsdp_check.sh $OUT/fsdp-check"
    PYTHON="$PY" timeout "${FSDP_TIMEOUT:-150}" bash bench/fsdp_check.sh "$OUT/fsdp-check" || rc=$((rc ? rc : $?))
  fi
  # vLLM at the 0.5B shape (VLLM=0 skips it, and it is skipped when vllm does not import): preftune's
  # engine beside its own sampler (bench/bench_vllm.py: s/step, tokens/s, the weight push's seconds), then
  # preftune's engine beside TRL's colocate mode (bench/suite.py --size gpu-vllm: s/step, tokens/s, peak
  # GPU memory, push seconds, both frameworks)
  if [ "${VLLM:-1}" != 0 ] && ! "$PY" -c 'import vllm' 2>/dev/null; then
    echo "== no vllm here: its rows are skipped (pip install 'preftune[vllm]'; VLLM=0 skips them quietly)"
  elif [ "${VLLM:-1}" != 0 ]; then
    echo "== $PY bench/bench_vllm.py --model rand0.5b --bf16 --model-cache $cache --json $OUT/bench-vllm.json"
    timeout "${VLLM_TIMEOUT:-600}" "$PY" bench/bench_vllm.py --model rand0.5b --bf16 --model-cache "$cache" \
      --json "$OUT/bench-vllm.json" || rc=$((rc ? rc : $?))
    echo "== $PY bench/suite.py --size gpu-vllm --json $OUT/bench-gpu-vllm.json --model-cache $cache"
    timeout "${VLLM_TIMEOUT:-600}" "$PY" bench/suite.py --size gpu-vllm --json "$OUT/bench-gpu-vllm.json" \
      --model-cache "$cache" || rc=$((rc ? rc : $?))
  fi
  # what full_determinism costs on this GPU, and whether two runs of each setting agree (DETERMINISM=0 skips it)
  if [ "${DETERMINISM:-1}" != 0 ]; then
    echo "== $PY bench/bench_determinism.py --json $OUT/bench-determinism.json"
    timeout "${DETERMINISM_TIMEOUT:-300}" "$PY" bench/bench_determinism.py --json "$OUT/bench-determinism.json" \
      || rc=$((rc ? rc : $?))
  fi
  [ "${SUITE:-1}" != 0 ] || return "$rc"  # SUITE=0: the steps above only
  echo "== $PY bench/suite.py $* --json $OUT/bench-gpu.json --model-cache $cache"
  time "$PY" bench/suite.py "$@" --json "$OUT/bench-gpu.json" --model-cache "$cache" || rc=$((rc ? rc : $?))
  return "$rc"
}

main "$@" 2>&1 | tee "$OUT/bench-gpu.log"
