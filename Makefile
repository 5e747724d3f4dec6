# dex-tasks: the one place the project's commands live.
PY ?= .venv/bin/python
PYTEST_ARGS ?=
export DEX_TEST_POSTGRES_URL ?= postgresql+psycopg://postgres@127.0.0.1:5432/test

.PHONY: install test lint worker beat api demo chaos bench

install:
	python3 -m venv .venv
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[dev,postgres]"

## make test: lint, then every test (real Redis, real workers, SQLite and PostgreSQL)
test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

lint:
	$(PY) -m ruff check dex_tasks workers tests beat_schedule.py
	$(PY) -m mypy dex_tasks workers beat_schedule.py

worker:
	.venv/bin/dex-tasks worker --tools workers.example_tools -c 2

beat:
	.venv/bin/dex-tasks beat

api:
	.venv/bin/dex-tasks api

## make demo: the whole system on embedded Redis + SQLite, every path, a summary table
demo:
	.venv/bin/dex-tasks demo
