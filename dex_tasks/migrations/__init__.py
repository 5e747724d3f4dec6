"""dex-tasks' Alembic migrations (run by ``dex_tasks.schema``; see its docstring)."""
