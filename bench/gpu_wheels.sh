#!/usr/bin/env bash
# Fetch, here, the wheels that the GPU machine lacks (it has no network) into .whl/ (git-ignored); the
# device run carries that folder and bench/gpu.sh installs it: run(carry=[".whl"], command="bash bench/gpu.sh").
#
# That machine has Python 3.12, torch 2.11, transformers 5.17, accelerate, peft, pyarrow, pandas, pyyaml,
# safetensors, tokenizers, xxhash, aiohttp, requests, tqdm, fsspec and huggingface-hub: everything
# preftune needs (pyproject's dependencies) but not TRL and datasets. So: TRL as pinned in pyproject's
# test extra; datasets 5.0.1, the newest whose declared needs (huggingface-hub >=0.25,<2 and pyarrow >=21)
# that machine surely meets (transformers 5.17 pins huggingface-hub <2; datasets >=5.1 wants hub >=1.31
# and pyarrow >=24), and TRL 1.16 asks for datasets >=4.7; and datasets' dill and multiprocess, at the
# versions its pins allow. All four are pure Python (multiprocess's wheel is per Python version: py312).
#
#   bash bench/gpu_wheels.sh            # PYVER=3.11 fetches the same set for this machine's Python
set -euo pipefail
cd "$(dirname "$0")/.."
trl=$(sed -n 's/.*"trl==\([0-9][0-9.]*\)".*/\1/p' pyproject.toml)
[ -n "$trl" ] || { echo "no trl==X pin in pyproject.toml" >&2; exit 1; }
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYVER:-3.12}" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "trl==$trl" datasets==5.0.1 dill==0.4.1 multiprocess==0.70.19
ls -l .whl
du -sh .whl
