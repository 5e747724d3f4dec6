"""dex-tasks' Alembic migrations (run by ``dex_tasks.store.schema``; see its docstring)."""
