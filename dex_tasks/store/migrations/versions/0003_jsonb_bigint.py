"""PostgreSQL types: ``jsonb`` for JSON, 64-bit event and message ids; the redundant index on
``dex_tool_calls.status`` replaced by ``(status, finished_at)``.

On PostgreSQL each JSON column becomes ``jsonb``. ALTER ... TYPE rewrites the table under an
exclusive lock, so run the upgrade with the workers stopped (they would wait for it). A stored
text jsonb refuses (a ``\\u0000`` escape, which only diagnostics could hold) gets U+FFFD in its
place; one that is not JSON at all is kept as a JSON string rather than lost.

Ids were ``serial`` (32 bits: about two billion events); the columns and their sequences become
``bigint``. SQLite's JSON stays ``TEXT`` and its ``INTEGER PRIMARY KEY`` is 64-bit already, so
there only the indexes change.

Revision ID: 0003_jsonb_bigint
Revises: 0002_transcript
"""

from __future__ import annotations

from alembic import op

revision = "0003_jsonb_bigint"
down_revision = "0002_transcript"
branch_labels = None
depends_on = None

JSON_COLUMNS = {
    "dex_tool_calls": ("arguments", "result"),
    "dex_call_events": ("detail",),
    "dex_messages": ("tool_arguments",),
    "dex_tool_catalog": ("policy", "hints", "arguments_schema"),
}
ID_TABLES = ("dex_call_events", "dex_messages")

# Session-local, dropped at the end. The EXCEPTION block costs a subtransaction per row, paid
# once, at the upgrade.
_TO_JSONB = r"""
CREATE FUNCTION pg_temp.dex_to_jsonb(value text) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
    RETURN value::jsonb;
EXCEPTION WHEN others THEN
    BEGIN
        RETURN replace(value, '\u0000', '\ufffd')::jsonb;
    EXCEPTION WHEN others THEN
        RETURN to_jsonb(value);
    END;
END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_TO_JSONB)
        for table, columns in JSON_COLUMNS.items():
            changes = ", ".join(
                f"ALTER COLUMN {c} TYPE jsonb USING pg_temp.dex_to_jsonb({c})" for c in columns)
            op.execute(f"ALTER TABLE {table} {changes}")
        op.execute("DROP FUNCTION pg_temp.dex_to_jsonb(text)")
        for table in ID_TABLES:
            op.execute(f"ALTER TABLE {table} ALTER COLUMN id TYPE bigint")
            op.execute(_alter_sequence(table, "bigint"))
    op.drop_index("ix_dex_tool_calls_status", table_name="dex_tool_calls")
    op.create_index("ix_dex_calls_status_finished", "dex_tool_calls", ["status", "finished_at"])


def downgrade() -> None:
    op.drop_index("ix_dex_calls_status_finished", table_name="dex_tool_calls")
    op.create_index("ix_dex_tool_calls_status", "dex_tool_calls", ["status"])
    if op.get_bind().dialect.name == "postgresql":
        for table in ID_TABLES:
            op.execute(_alter_sequence(table, "integer"))
            op.execute(f"ALTER TABLE {table} ALTER COLUMN id TYPE integer")
        for table, columns in JSON_COLUMNS.items():
            changes = ", ".join(f"ALTER COLUMN {c} TYPE text USING {c}::text" for c in columns)
            op.execute(f"ALTER TABLE {table} {changes}")


def _alter_sequence(table: str, type_: str) -> str:
    # ALTER SEQUENCE takes a name, not an expression: look it up and run it in one statement.
    return (f"DO $$ BEGIN EXECUTE format('ALTER SEQUENCE %s AS {type_}', "
            f"pg_get_serial_sequence('{table}', 'id')); END $$")
