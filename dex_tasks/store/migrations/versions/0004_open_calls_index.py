"""An index for ``/metrics``: ``dex_tool_calls (status, tool, effect)``.

A scrape gauges the open calls (awaiting approval, queued, running) by tool and effect class
from this index alone, so its cost follows the open calls, never the ended ones, which grow
for ever; the ended ones are counted in Redis as they end.

Revision ID: 0004_open_calls_index
Revises: 0003_jsonb_bigint
"""

from __future__ import annotations

from alembic import op

revision = "0004_open_calls_index"
down_revision = "0003_jsonb_bigint"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_dex_calls_status_tool_effect", "dex_tool_calls",
                    ["status", "tool", "effect"])


def downgrade() -> None:
    op.drop_index("ix_dex_calls_status_tool_effect", table_name="dex_tool_calls")
