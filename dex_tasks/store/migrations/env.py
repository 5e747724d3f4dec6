"""Alembic environment of dex-tasks, run in-process by ``dex_tasks.store.schema``.

``schema`` hands over a connection that is already inside its transaction (and, on PostgreSQL,
holds the schema lock), so the migrations commit or roll back with it as one unit. There is no
alembic.ini and no offline (``--sql``) mode.
"""

from __future__ import annotations

from typing import Any

from alembic import context
from sqlmodel import SQLModel

import dex_tasks.store.models  # noqa: F401 - registers the tables that autogenerate compares

config = context.config
connection = config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "dex-tasks' migrations run through `dex-tasks db upgrade` (dex_tasks.store.schema), "
        "which passes them a connection; there is no alembic.ini"
    )


def include_name(name: str | None, type_: str, _parent: Any) -> bool:
    """Only dex-tasks' own tables: the database may hold other applications' too."""
    return type_ != "table" or bool(name and name.startswith("dex_"))


context.configure(
    connection=connection,
    target_metadata=SQLModel.metadata,
    version_table=config.attributes["version_table"],
    include_name=include_name,
    # SQLite cannot ALTER most things: autogenerate writes batch operations for it.
    render_as_batch=connection.dialect.name == "sqlite",
    compare_type=True,
    compare_server_default=True,
)
with context.begin_transaction():
    context.run_migrations()
