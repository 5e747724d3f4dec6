"""dex-tasks: run AI agents' tool calls as Celery tasks whose behaviour follows the effect class.

The public names are re-exported here; see ``DESIGN.md`` for the contract they keep.
"""

from dex_tasks.agent.approvals import ApproverPermissionError, InvalidEditError
from dex_tasks.agent.async_client import AsyncDexClient
from dex_tasks.agent.calls import ToolCallRequest, key_part
from dex_tasks.agent.client import DexClient, idempotency_key
from dex_tasks.agent.reconcile import report_unknown_outcomes, report_unknown_outcomes_sync
from dex_tasks.errors import (
    CallNotFoundError,
    ConfigurationError,
    ConflictError,
    DexError,
    ForbiddenSessionError,
    IllegalTransitionError,
    InvalidArgumentError,
    InvalidCallError,
    InvalidTokenError,
    OutcomeUnknownError,
    PrunedCallError,
    SchemaOutOfDateError,
    StoreUnavailableError,
    ToolDefinitionError,
    TransientToolError,
    TurnConflictError,
    UnknownToolError,
)
from dex_tasks.policy import EffectClass, InvalidPolicyError, ToolPolicy
from dex_tasks.registry import Tool, ToolContext, define_tool, tool
from dex_tasks.rules import ApprovalRule, RuleError, when
from dex_tasks.settings import DexSettings
from dex_tasks.states import (
    OUTCOME_UNKNOWN_TOOL_RESULT,
    TOOL_DID_NOT_RUN,
    CallStatus,
    MessageRole,
)
from dex_tasks.store.catalog import ToolSpec
from dex_tasks.store.deadlines import APPROVAL_DEADLINE_PASSED, APPROVAL_REJECTED
from dex_tasks.store.records import (
    AgentSnapshot,
    CallEvent,
    Decision,
    PendingInterrupt,
    SessionMessage,
    ToolCallRecord,
    Turn,
    TurnStep,
)
from dex_tasks.tokens import TokenClaims, issue_token, read_token, verify_token
from dex_tasks.webhooks import WebhookSignatureError, verify_webhook

__all__ = [
    "APPROVAL_DEADLINE_PASSED",
    "APPROVAL_REJECTED",
    "OUTCOME_UNKNOWN_TOOL_RESULT",
    "TOOL_DID_NOT_RUN",
    "AgentSnapshot",
    "ApprovalRule",
    "ApproverPermissionError",
    "AsyncDexClient",
    "CallEvent",
    "CallNotFoundError",
    "CallStatus",
    "ConfigurationError",
    "ConflictError",
    "Decision",
    "DexClient",
    "DexError",
    "DexSettings",
    "EffectClass",
    "ForbiddenSessionError",
    "IllegalTransitionError",
    "InvalidArgumentError",
    "InvalidCallError",
    "InvalidEditError",
    "InvalidPolicyError",
    "InvalidTokenError",
    "MessageRole",
    "OutcomeUnknownError",
    "PendingInterrupt",
    "PrunedCallError",
    "RuleError",
    "SchemaOutOfDateError",
    "SessionMessage",
    "StoreUnavailableError",
    "TokenClaims",
    "Tool",
    "ToolCallRecord",
    "ToolCallRequest",
    "ToolContext",
    "ToolDefinitionError",
    "ToolPolicy",
    "ToolSpec",
    "TransientToolError",
    "Turn",
    "TurnConflictError",
    "TurnStep",
    "UnknownToolError",
    "WebhookSignatureError",
    "define_tool",
    "idempotency_key",
    "issue_token",
    "key_part",
    "read_token",
    "report_unknown_outcomes",
    "report_unknown_outcomes_sync",
    "tool",
    "verify_token",
    "verify_webhook",
    "when",
]
