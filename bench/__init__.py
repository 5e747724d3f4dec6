"""Benchmarks of dex-tasks against plain Celery (issue 6).

Run ``python -m bench --help`` (or ``make bench``). Each command starts what it measures (a
private ``redis-server``, fresh databases, real worker subprocesses), prints a table with the
targets of issue 6 beside the figures, and writes a JSON file under ``bench/results/``.

Benchmarks report; they never assert anything about time.
"""
