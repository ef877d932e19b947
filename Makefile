VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: serve test lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# `make serve LISTEN=127.0.0.1:9000` serves on another address (default: config.toml, else 127.0.0.1:8770)
LISTEN ?=

serve: $(STAMP)
	$(VENV)/bin/appserver serve $(if $(LISTEN),--listen $(LISTEN))

test: $(STAMP)
	$(PY) -m pytest -x -q -n 6 --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check appserver cron gateway plugins tests bench examples
	$(VENV)/bin/ruff format --check appserver cron gateway plugins tests bench examples
	$(VENV)/bin/mypy appserver gateway plugins

BENCH_STAMP := $(VENV)/.bench-stamp

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(BENCH_STAMP)

# the comparison table (docs/benchmarks.md); LiteLLM joins it when installed (LITELLM_BIN=… or on PATH)
bench: $(BENCH_STAMP)
	$(PY) bench/compare.py $(BENCH_ARGS)
	$(PY) bench/kernel.py

clean:
	rm -rf $(VENV)
