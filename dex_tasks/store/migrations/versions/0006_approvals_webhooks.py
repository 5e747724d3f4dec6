"""Approvals that reach people: rules, edits, several approvers, webhooks.

``dex_tool_calls`` gets ``original_arguments`` (the model's arguments when a person approved
edited ones) and ``approval_rule`` (the rule on the arguments that decided, in the policy
snapshot). ``dex_interrupts`` gets the several-approvers snapshot (``approvals_required``,
``approvals_given``, ``approver_permission``), the tool's ``webhook_urls`` and
``deadline_warned_at``. New tables: ``dex_approvals`` (one row per approval of an interrupt that
needs several) and ``dex_webhooks`` (the webhook outbox and its delivery attempts). Every new
column is nullable or has a server default, so rows already stored read as before.

Revision ID: 0006_approvals_webhooks
Revises: 0005_durable_turns
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_approvals_webhooks"
down_revision = "0005_durable_turns"
branch_labels = None
depends_on = None


def _json() -> sa.types.TypeEngine[str]:
    # JSON is jsonb on PostgreSQL and TEXT on SQLite (store/sqljson.py), as in 0003.
    if op.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import JSONB

        return JSONB()  # type: ignore[return-value]
    return sa.Text()


def upgrade() -> None:
    with op.batch_alter_table("dex_tool_calls") as batch:
        batch.add_column(sa.Column("original_arguments", _json(), nullable=True))
        batch.add_column(sa.Column("approval_rule", _json(), nullable=True))
    with op.batch_alter_table("dex_interrupts") as batch:
        batch.add_column(sa.Column("approvals_required", sa.Integer(), server_default="1",
                                   nullable=False))
        batch.add_column(sa.Column("approvals_given", sa.Integer(), server_default="0",
                                   nullable=False))
        batch.add_column(sa.Column("approver_permission", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("webhook_urls", _json(), nullable=True))
        batch.add_column(sa.Column("deadline_warned_at", sa.Float(), nullable=True))
    op.create_table(
        "dex_approvals",
        sa.Column("interrupt_id", sa.String(length=64), nullable=False),
        sa.Column("approver", sa.String(length=200), nullable=False),
        sa.Column("decided_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("interrupt_id", "approver"),
    )
    op.create_table(
        "dex_webhooks",
        sa.Column("delivery_id", sa.String(length=64), nullable=False),
        sa.Column("event_id", sa.String(length=64), nullable=False),
        sa.Column("event", sa.String(length=64), nullable=False),
        sa.Column("session_id", sa.String(length=200), nullable=False),
        sa.Column("key", sa.String(length=512), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("payload", _json(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("published_at", sa.Float(), nullable=True),
        sa.Column("delivered_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("delivery_id"),
    )
    op.create_index("ix_dex_webhooks_event_id", "dex_webhooks", ["event_id"])
    op.create_index("ix_dex_webhooks_key", "dex_webhooks", ["key"])
    op.create_index("ix_dex_webhooks_status_published", "dex_webhooks",
                    ["status", "published_at"])


def downgrade() -> None:
    op.drop_index("ix_dex_webhooks_status_published", table_name="dex_webhooks")
    op.drop_index("ix_dex_webhooks_key", table_name="dex_webhooks")
    op.drop_index("ix_dex_webhooks_event_id", table_name="dex_webhooks")
    op.drop_table("dex_webhooks")
    op.drop_table("dex_approvals")
    with op.batch_alter_table("dex_interrupts") as batch:
        for column in ("deadline_warned_at", "webhook_urls", "approver_permission",
                       "approvals_given", "approvals_required"):
            batch.drop_column(column)
    with op.batch_alter_table("dex_tool_calls") as batch:
        batch.drop_column("approval_rule")
        batch.drop_column("original_arguments")
