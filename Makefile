# The interface: install, up, demo, test, lint, bench-rollout, bench-train, chaos, gpu-smoke.
# Every target does its own set-up on a fresh machine (`install` is a prerequisite).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
EXTRAS ?= embedded,envs,data,hf,trainer,dev
PYTEST_ARGS ?=

.PHONY: browser-deps install up demo test test-unit test-integration lint bench-rollout bench-train bench-load chaos gpu-smoke clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml infra/constraints-cpu.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c infra/constraints-cpu.txt -e ".[$(EXTRAS)]"
	touch $@

up: install
	$(VENV)/bin/flywheel-stack

demo: install
	$(PY) -m bench.demo

test: install browser-deps
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
	$(VENV)/bin/ruff check shared services infra tests bench migrations

bench-rollout: install
	$(PY) -m bench.rollout

bench-train: install
	$(PY) -m bench.train

bench-load: install
	$(PY) -m bench.load

chaos: install
	$(PY) -m bench.chaos

gpu-smoke: install
	$(PY) -m bench.gpu_smoke

clean:
	rm -rf $(VENV) .data .pytest_cache
