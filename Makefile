# diffulex-triton: set-up, serving and tests.
#
#   make serve   set everything up, then run tritonserver on model_repository (ports HTTP_PORT/GRPC_PORT/METRICS_PORT)
#                and the OpenAI-compatible front next to it (OPENAI_PORT)
#   make test    set everything up, then run the whole test suite
#
# Set-up is idempotent: each step leaves a stamp under .venv/.stamps and is redone only when its inputs
# change, so a second `make test` goes straight to pytest.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMPS := $(VENV)/.stamps
RUNTIME := .runtime
MODEL_REPOSITORY := model_repository
PYTEST_ARGS ?=

# torch==2.13.0 resolves to the CPU build kept on local disk; a bare `torch` would pull a CUDA build.
# numpy must stay below 2: the Python backend stub crashes on every STRING input with numpy 2.
# kubernetes-validate carries the Kubernetes API's JSON schemas, so the tests check deploy/ without a network.
# fastapi and uvicorn run the OpenAI-compatible front; the official openai client is what its tests speak.
PYTHON_PACKAGES := torch==2.13.0 "numpy<2" safetensors transformers==5.17.0 tqdm triton==3.6.0 \
	"tritonclient[all]==2.51.0" nvidia-pytriton==0.7.0 pytest pytest-timeout hypothesis==6.170.15 \
	kubernetes-validate==1.37.0 jsonschema==4.26.0 fastapi==0.163.2 uvicorn==0.54.0 openai==3.51.0
# libb64-0d: the perf_analyzer binary inside tritonclient links against it.
APT_PACKAGES := libb64-0d

.PHONY: setup test-setup serve test

setup: $(STAMPS)/project $(BIN)/tritonserver

test-setup: setup

# The ports of `make serve`, and of the server `make perf` starts when none answers on PERF_URL.
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
# The OpenAI-compatible front (client/openai_front), as Triton's own OpenAI frontend listens.
OPENAI_PORT ?= 9000

# Triton 2.51's HTTP front end crashes on a request body of about 4.19 MB and has no option to refuse one, so its
# port listens on loopback unless TRITON_HTTP_ADDRESS opens it (0.0.0.0: every host; put a proxy with a body limit
# in front). gRPC refuses large messages itself.
TRITON_HTTP_ADDRESS ?= 127.0.0.1

# How long tritonserver waits, once stopped, for open connections and requests, and for its models to unload.
# Past it, an open gRPC stream still holds Triton 2.51 for ever, so tools/serve.py kills a server that has not exited
# 5 s later (docs/reliability.md, "Shutdown and unload finish").
EXIT_TIMEOUT_SECS ?= 30

# Explicit model control lets the model's watchdog reload it when its stub dies (docs/reliability.md).
# tools/serve.py runs the front beside the server, forwards SIGINT/SIGTERM to the server and stops the front with it.
serve: setup
	$(BIN)/python tools/serve.py --openai-port $(OPENAI_PORT) --grpc-port $(GRPC_PORT) \
		--model-repository $(MODEL_REPOSITORY) -- \
		$(BIN)/tritonserver --model-repository $(MODEL_REPOSITORY) \
		--model-control-mode=explicit --load-model=diffulex --http-address $(TRITON_HTTP_ADDRESS) \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		--exit-timeout-secs $(EXIT_TIMEOUT_SECS)

# Without a GPU the Triton kernels run under Triton's interpreter. It must be on before the first kernel is
# defined, and the first test module to import the kernels may lie outside tests/kernels.
TRITON_INTERPRET ?= $(if $(shell nvidia-smi -L 2>/dev/null),0,1)

# pytest exits 5 when it collects nothing; make fails on it like on any other non-zero status.
test: setup
	TRITON_INTERPRET=$(TRITON_INTERPRET) $(BIN)/python -m pytest $(PYTEST_ARGS)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMPS)/apt:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing; \
	fi
	@mkdir -p $(STAMPS) && touch $@

# The stamp is named after the package list, so changing a pin reinstalls and editing anything else does not.
PACKAGES_STAMP := $(STAMPS)/python-packages-$(shell echo '$(PYTHON_PACKAGES)' | md5sum | cut -c1-12)

$(PACKAGES_STAMP): | $(BIN)/python
	$(BIN)/python -m pip install $(PYTHON_PACKAGES)
	@mkdir -p $(STAMPS) && touch $@

# Reinstalled when a renamed package folder gains its __init__.py, so the editable finder maps it.
$(STAMPS)/project: pyproject.toml setup.py $(wildcard kernels/__init__.py client/__init__.py) \
		$(PACKAGES_STAMP) $(STAMPS)/apt
	$(BIN)/python -m pip install --quiet -e .
	@touch $@

$(BIN)/tritonserver: tools/install_tritonserver.py $(PACKAGES_STAMP)
	$(BIN)/python tools/install_tritonserver.py $(RUNTIME)

# The GPU benchmark: the engine's forward and decode step against the device's floors and plain PyTorch
# (benchmarks/forward.py; results in docs/performance.md). It needs only a Python with torch and triton, so it
# skips `setup`. BENCH_ARGS, e.g.: --out DIR --models llada-8b,dream-7b (--smoke: a tiny model on any device).
BENCH_ARGS ?=

.PHONY: bench
bench:
	PYTHONPATH=. $(PYTHON) benchmarks/forward.py $(BENCH_ARGS)

# The demo models' decoding quality table and plot (docs/quality.md, docs/quality.png), measured on CPU.
.PHONY: quality
quality: $(STAMPS)/project
	$(BIN)/python -m pip install -q matplotlib
	$(BIN)/python benchmarks/quality.py

# Load tests (client/perf/): perf_analyzer over gRPC streaming at a concurrency sweep, in count windows with
# profile exports, then a table of requests/s, output tokens/s and p50/p99 time to first response and request
# latency computed from the exports. A server already answering on PERF_URL is used; otherwise one is started
# on model_repository for the run. When a level fails, the finished levels' table is printed, then the failure,
# and make fails. PERF_ARGS, e.g.: --requests-per-window 16 --output-dir DIR.
PERF_URL ?= localhost:$(GRPC_PORT)
PERF_INPUT ?= client/perf/medium_streaming.json
PERF_CONCURRENCY ?= 1 2 4 8
PERF_ARGS ?=

.PHONY: perf
perf: setup
	$(BIN)/python -m diffulex_client.perf.sweep --url $(PERF_URL) --input-data $(PERF_INPUT) \
		--concurrency $(PERF_CONCURRENCY) --http-port $(HTTP_PORT) --metrics-port $(METRICS_PORT) $(PERF_ARGS)

# perf_analyzer (in the tritonclient wheel) needs libb64-0d, an APT_PACKAGES entry, and libcudart.so.12, which
# this wheel provides even without a GPU; tools/wrap_perf_analyzer.py puts it on perf_analyzer's library path, so
# that the venv's perf_analyzer runs as it is. Redone after a package reinstall, which puts the bare binary back.
# It is part of setup because the test suite runs perf_analyzer too.
setup: $(STAMPS)/perf-tools

$(STAMPS)/perf-tools: tools/wrap_perf_analyzer.py $(PACKAGES_STAMP)
	$(BIN)/python -m pip install nvidia-cuda-runtime-cu12==12.9.79
	$(BIN)/python tools/wrap_perf_analyzer.py $(BIN)
	@mkdir -p $(STAMPS) && touch $@

# genai-perf, NVIDIA's benchmark client, in a virtual environment of its own: it installs a placeholder
# perf-analyzer package and pins libraries of its own. It is part of setup because the test suite runs it.
# `make genai-perf` runs it against a running server in each Triton request shape (client/perf/genai_perf.py).
GENAI_PERF_VENV := .venv-genai-perf
GENAI_PERF_ARGS ?=

setup: $(GENAI_PERF_VENV)/bin/genai-perf

$(GENAI_PERF_VENV)/bin/genai-perf:
	$(PYTHON) -m venv $(GENAI_PERF_VENV)
	$(GENAI_PERF_VENV)/bin/pip install genai-perf==0.0.16 "numpy<2"

# `make genai-perf-setup` builds that environment alone.
.PHONY: genai-perf-setup
genai-perf-setup: $(GENAI_PERF_VENV)/bin/genai-perf

# GENAI_PERF_ARGS, e.g.: --modes completions chat (the OpenAI front that `make serve` runs on OPENAI_PORT).
.PHONY: genai-perf
genai-perf: setup
	$(BIN)/python -m diffulex_client.perf.genai_perf --grpc-url localhost:$(GRPC_PORT) \
		--http-url localhost:$(HTTP_PORT) --openai-url localhost:$(OPENAI_PORT) $(GENAI_PERF_ARGS)

# What only a GPU can check (tools/gpu_check.py), on a GPU machine: kernels and graphs, the offline API, every family
# and strategy served through tritonserver, and the server and client suites; the table goes to docs/gpu-check.md.
# A GPU machine without a network gets the server runtime from `make gpu-runtime`, run here first, in .gpu-runtime.
GPU_CHECK_ARGS ?=

# flash-attn's Hopper kernels (attention_backend flash_attn, which `auto` takes for prompts on a GPU of compute
# capability 9.0 or newer), and the CuTe DSL they compile with at run time, for an image with CUDA 13 torch. The
# image already holds the rest they need (torch, einops, cuda-bindings). `make setup-gpu` installs them into the
# GPU machine's Python (PYTHON=); `make gpu-runtime` packs them for one without a network.
FLASH_ATTN_PACKAGES := flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
	nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 \
	torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5

.PHONY: gpu-check gpu-runtime setup-gpu
gpu-check:
	$(PYTHON) tools/gpu_check.py $(GPU_CHECK_ARGS)

gpu-runtime: setup
	$(BIN)/python tools/pack_gpu_runtime.py pack --flash-attn "$(FLASH_ATTN_PACKAGES)" --perf-analyzer

setup-gpu:
	$(PYTHON) -m pip install --no-deps $(FLASH_ATTN_PACKAGES)
