"""dex-tasks: run AI agents' tool calls as Celery tasks whose behaviour follows the effect class.

The public names are re-exported here; see ``DESIGN.md`` for the contract they keep.
"""

from dex_tasks.client import DexClient, InvalidCallError, idempotency_key
from dex_tasks.errors import (
    CallNotFoundError,
    ConfigurationError,
    ConflictError,
    DexError,
    IllegalTransitionError,
    InvalidTokenError,
    StoreUnavailableError,
    ToolDefinitionError,
    TransientToolError,
    UnknownToolError,
)
from dex_tasks.policy import EffectClass, InvalidPolicyError, ToolPolicy
from dex_tasks.records import AgentSnapshot, CallEvent, ToolCallRecord
from dex_tasks.registry import Tool, ToolContext, tool
from dex_tasks.settings import DexSettings
from dex_tasks.states import OUTCOME_UNKNOWN_TOOL_RESULT, TOOL_DID_NOT_RUN, CallStatus

__all__ = [
    "OUTCOME_UNKNOWN_TOOL_RESULT",
    "TOOL_DID_NOT_RUN",
    "AgentSnapshot",
    "CallEvent",
    "CallNotFoundError",
    "CallStatus",
    "ConfigurationError",
    "ConflictError",
    "DexClient",
    "DexError",
    "DexSettings",
    "EffectClass",
    "IllegalTransitionError",
    "InvalidCallError",
    "InvalidPolicyError",
    "InvalidTokenError",
    "StoreUnavailableError",
    "Tool",
    "ToolCallRecord",
    "ToolContext",
    "ToolDefinitionError",
    "ToolPolicy",
    "TransientToolError",
    "UnknownToolError",
    "idempotency_key",
    "tool",
]
