"""dex-tasks: run AI agents' tool calls as Celery tasks whose behaviour follows the effect class.

The public names are importable from here (``from dex_tasks import DexClient, tool``); they are
the names the project keeps stable (docs/reference.md lists them). Each is imported on first
use (PEP 562), so ``import dex_tasks`` costs almost nothing: an agent process that only needs
``DexClient`` never imports the worker side, and a tool module that only needs ``@tool`` never
imports Celery's app or SQLAlchemy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dex_tasks.lazy import module_attributes

if TYPE_CHECKING:
    from dex_tasks.agent.approvals import (
        ApproverPermissionError,
        InvalidEditError,
        SelfApprovalError,
        StaleApprovalError,
    )
    from dex_tasks.agent.async_client import AsyncDexClient
    from dex_tasks.agent.calls import ToolCallRequest, key_part
    from dex_tasks.agent.client import DexClient, idempotency_key
    from dex_tasks.agent.reconcile import report_unknown_outcomes, report_unknown_outcomes_sync
    from dex_tasks.arguments import InvalidArguments, normalize_arguments
    from dex_tasks.errors import (
        BrokerRefusedError,
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
        StoreRefusedError,
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
    from dex_tasks.store.transcript import tool_message_text
    from dex_tasks.tokens import TokenClaims, issue_token, read_token, token_identity, verify_token
    from dex_tasks.webhooks import WebhookSignatureError, verify_webhook
_LAZY: dict[str, str] = {
    "InvalidArguments": "dex_tasks.arguments",
    "normalize_arguments": "dex_tasks.arguments",
    "ApprovalRule": "dex_tasks.rules",
    "ApproverPermissionError": "dex_tasks.agent.approvals",
    "SelfApprovalError": "dex_tasks.agent.approvals",
    "InvalidEditError": "dex_tasks.agent.approvals",
    "StaleApprovalError": "dex_tasks.agent.approvals",
    "RuleError": "dex_tasks.rules",
    "WebhookSignatureError": "dex_tasks.webhooks",
    "verify_webhook": "dex_tasks.webhooks",
    "when": "dex_tasks.rules",
    "AsyncDexClient": "dex_tasks.agent.async_client",
    "ToolCallRequest": "dex_tasks.agent.calls",
    "DexClient": "dex_tasks.agent.client",
    "idempotency_key": "dex_tasks.agent.client",
    "report_unknown_outcomes": "dex_tasks.agent.reconcile",
    "report_unknown_outcomes_sync": "dex_tasks.agent.reconcile",
    "CallNotFoundError": "dex_tasks.errors",
    "ConfigurationError": "dex_tasks.errors",
    "ConflictError": "dex_tasks.errors",
    "DexError": "dex_tasks.errors",
    "ForbiddenSessionError": "dex_tasks.errors",
    "IllegalTransitionError": "dex_tasks.errors",
    "InvalidArgumentError": "dex_tasks.errors",
    "InvalidCallError": "dex_tasks.errors",
    "InvalidTokenError": "dex_tasks.errors",
    "OutcomeUnknownError": "dex_tasks.errors",
    "PrunedCallError": "dex_tasks.errors",
    "SchemaOutOfDateError": "dex_tasks.errors",
    "StoreRefusedError": "dex_tasks.errors",
    "StoreUnavailableError": "dex_tasks.errors",
    "BrokerRefusedError": "dex_tasks.errors",
    "ToolDefinitionError": "dex_tasks.errors",
    "TransientToolError": "dex_tasks.errors",
    "TurnConflictError": "dex_tasks.errors",
    "UnknownToolError": "dex_tasks.errors",
    "EffectClass": "dex_tasks.policy",
    "InvalidPolicyError": "dex_tasks.policy",
    "ToolPolicy": "dex_tasks.policy",
    "Tool": "dex_tasks.registry",
    "ToolContext": "dex_tasks.registry",
    "define_tool": "dex_tasks.registry",
    "tool": "dex_tasks.registry",
    "DexSettings": "dex_tasks.settings",
    "CallStatus": "dex_tasks.states",
    "MessageRole": "dex_tasks.states",
    "OUTCOME_UNKNOWN_TOOL_RESULT": "dex_tasks.states",
    "TOOL_DID_NOT_RUN": "dex_tasks.states",
    "ToolSpec": "dex_tasks.store.catalog",
    "APPROVAL_DEADLINE_PASSED": "dex_tasks.store.deadlines",
    "APPROVAL_REJECTED": "dex_tasks.store.deadlines",
    "AgentSnapshot": "dex_tasks.store.records",
    "CallEvent": "dex_tasks.store.records",
    "Decision": "dex_tasks.store.records",
    "PendingInterrupt": "dex_tasks.store.records",
    "SessionMessage": "dex_tasks.store.records",
    "ToolCallRecord": "dex_tasks.store.records",
    "Turn": "dex_tasks.store.records",
    "TurnStep": "dex_tasks.store.records",
    "tool_message_text": "dex_tasks.store.transcript",
    "TokenClaims": "dex_tasks.tokens",
    "issue_token": "dex_tasks.tokens",
    "key_part": "dex_tasks.agent.calls",
    "read_token": "dex_tasks.tokens",
    "token_identity": "dex_tasks.tokens",
    "verify_token": "dex_tasks.tokens",
}
"""Each public name and the module that defines it."""

__all__ = [
    "APPROVAL_DEADLINE_PASSED",
    "APPROVAL_REJECTED",
    "OUTCOME_UNKNOWN_TOOL_RESULT",
    "TOOL_DID_NOT_RUN",
    "AgentSnapshot",
    "ApprovalRule",
    "ApproverPermissionError",
    "AsyncDexClient",
    "BrokerRefusedError",
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
    "InvalidArguments",
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
    "SelfApprovalError",
    "SessionMessage",
    "StaleApprovalError",
    "StoreRefusedError",
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
    "normalize_arguments",
    "read_token",
    "report_unknown_outcomes",
    "report_unknown_outcomes_sync",
    "token_identity",
    "tool",
    "tool_message_text",
    "verify_token",
    "verify_webhook",
    "when",
]


__getattr__, __dir__ = module_attributes(__name__, globals(), _LAZY)
