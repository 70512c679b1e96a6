# `make help` lists the targets. The environment lives in .venv and is rebuilt when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help run test test-fast docs lint format ui clean

help: ## show this help
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -e ".[dev]"
	@touch $(STAMP)

run: $(STAMP) ## train with the defaults (MLP on the bundled digits, CPU or best GPU); extra overrides: make run ARGS="model=resnet50 amp=true"
	$(PY) -m pipeline $(ARGS)

test: $(STAMP) ## lint, then the whole test suite (what CI runs)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy  # [tool.mypy] in pyproject.toml says what it checks
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site  # not --quiet: it hides the warnings that --strict counts
	$(PY) -m pytest -n 2 --dist worksteal  # an idle worker takes tests queued for the other

test-fast: $(STAMP) ## the quick inner loop: tests not marked slow
	$(PY) -m pytest -m "not slow" -x -q -n 2 --dist worksteal

docs: $(STAMP) ## build the documentation pages (docs/) into site/; a broken link or anchor fails
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site
	@echo "open site/index.html, or serve it: .venv/bin/mkdocs serve"

format: $(STAMP) ## apply ruff's formatter and safe fixes
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

ui: $(STAMP) ## open the MLflow UI on the local store (http://127.0.0.1:5000)
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db

clean: ## remove run outputs (MLflow store, unsent metrics, checkpoints, Hydra dirs, compare/), keep the environment
	rm -rf mlruns mlflow.db mlflow.db.lock unsent_metrics checkpoints outputs multirun compare site
