"""The example tools (``dex_tasks.examples.tools``) that ``dex-tasks demo``, the tests and the
docs run, and the fsynced ledger (``dex_tasks.examples.ledger``) they record executions in.

Some misbehave on purpose (a flaky read, a tool that outlives its time limit): run them only
where you mean to, e.g. ``dex-tasks worker --tools dex_tasks.examples.tools``. The repository's
``workers/example_tools.py`` re-exports them under their historical name.
"""
