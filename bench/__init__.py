"""Benchmarks of dex-tasks against plain Celery (issues 6 and 12) and of /metrics (issue 11).

Run ``python -m bench --help`` (or ``make bench``). Each command starts what it measures (a
private ``redis-server``, fresh databases, real worker subprocesses), prints a table with the
targets beside the figures, and writes a JSON file under ``bench/results/``. Variants that are
compared run side by side in one run, alternating, so that the load of a shared machine falls on
all of them alike.

Benchmarks report; they never assert anything about time.
"""
