"""The chaos harness of dex-tasks: a mixed load against real workers, beat and Redis, under
scheduled SIGKILLs and a Redis restart, followed by a check of every guarantee.

Run ``python -m chaos --help`` (or ``make chaos`` for the long run).
"""
