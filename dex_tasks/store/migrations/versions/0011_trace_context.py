"""The call's trace context: the W3C ``traceparent`` of the span that requested it.

With OpenTelemetry configured in the agent process, ``call_tool`` stores the context of its
span with the call, so that whatever happens to the call later, in whichever process (a worker,
a republish by beat, an approval decided days later through the API), joins the agent's trace.
NULL when the agent process does not trace (see ``dex_tasks/tracing.py``).

Revision ID: 0011_trace_context
Revises: 0010_self_approval
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011_trace_context"
down_revision = "0010_self_approval"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("dex_tool_calls") as batch:
        batch.add_column(sa.Column("trace_context", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("dex_tool_calls") as batch:
        batch.drop_column("trace_context")
