# dex-tasks: the one place the project's commands live.
PY ?= .venv/bin/python
PYTEST_ARGS ?=
export DEX_TEST_POSTGRES_URL ?= postgresql+psycopg://postgres@127.0.0.1:5432/test

.PHONY: install test lint worker beat api demo chaos bench

install:
	python3 -m venv .venv
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[dev,postgres,otel,pydantic-ai,openai-agents,langchain,mcp,google-adk,crewai]"

## make test: lint, then every test but the long scenarios (real Redis, real workers, SQLite and
## PostgreSQL); `make chaos` runs the long ones (pytest -m long), each with a short
## representative here
test: lint
	$(PY) -m pytest -m "not long" $(PYTEST_ARGS)

lint:
	$(PY) -m ruff check dex_tasks workers tests bench chaos examples beat_schedule.py
	$(PY) -m mypy dex_tasks workers bench chaos examples beat_schedule.py

worker:
	.venv/bin/dex-tasks worker --tools workers.example_tools -c 2

beat:
	.venv/bin/dex-tasks beat

api:
	.venv/bin/dex-tasks api

## make demo: the whole system on embedded Redis + SQLite, every path, a summary table; then it
## keeps running, a refund waiting for you on the session page, until Ctrl-C
demo:
	.venv/bin/dex-tasks demo --keep-running

## make bench: dex-tasks vs raw Celery side by side (throughput, one call at a time, call_tools,
## I/O-bound calls on the threads pool), /metrics scrape cost, sweep scale, worker memory; the
## targets of issues 6, 11 and 12 (reported, not asserted). BENCH_ARGS="--quick" for small
## sizes; JSON in bench/results/
BENCH_ARGS ?=
bench:
	$(PY) -m bench all $(BENCH_ARGS)

## make chaos: the long chaos run (thousands of mixed calls, SIGKILLed workers, a Redis crash);
## prints its figures and fails on any broken guarantee. CHAOS_ARGS="--database-url ..." etc.
CHAOS_ARGS ?=
## Then the network partitions of issue 19 (chaos/partitions.py; root, iproute2, iptables,
## PostgreSQL): hosts in network namespaces, silent drops, production timings. PARTITION_ARGS
## e.g. "--scenario P1".
PARTITION_ARGS ?=
## Then the fleet of issue 30 (chaos/fleet.py; root, iproute2, iptables, pgbouncer, PostgreSQL's
## server binaries): the curve from 1 to 40 worker processes, a Sentinel failover under load,
## and a 30-minute soak. FLEET_ARGS e.g. "--soak-minutes 5".
FLEET_ARGS ?=
chaos:
	$(PY) -m pytest -m long $(PYTEST_ARGS)
	$(PY) -m chaos --calls 3000 --workers 3 --duration 120 $(CHAOS_ARGS)
	$(PY) -m chaos.partitions $(PARTITION_ARGS)
	$(PY) -m chaos.fleet --soak-minutes 30 $(FLEET_ARGS)
