"""Durable turns: the steps of a run's turn, as the message history shows them, and the
journaled form of a model response.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic_ai import ModelMessage, ModelRequest, ModelResponse, UserPromptPart
from pydantic_ai.messages import ModelMessagesTypeAdapter, RetryPromptPart, ToolReturnPart
from pydantic_core import to_jsonable_python

from dex_tasks import DexError, ToolCallRecord, Turn
from dex_tasks.integrations.pydantic_ai.keys import fit_id

# -- durable turns ------------------------------------------------------------------------------


def _begins_turn(message: ModelMessage) -> bool:
    # A user prompt beside tool results is a tool's ToolReturn(content=...) (the edit note of
    # an edited call is one), which continues the turn; a prompt alone begins one.
    return isinstance(message, ModelRequest) and any(
        isinstance(part, UserPromptPart) for part in message.parts) and not any(
        isinstance(part, ToolReturnPart | RetryPromptPart) for part in message.parts)


def step_position(messages: Sequence[ModelMessage], upto: int | None = None) -> int:
    """The step of the turn a model response at ``messages[upto]`` has (default: the next
    response, after ``messages``): how many responses follow the turn's user prompt."""
    end = len(messages) if upto is None else upto
    position = 0
    for message in messages[:end]:
        if _begins_turn(message):
            position = 0
        elif isinstance(message, ModelResponse):
            position += 1
    return position


def step_call_id(position: int, tool_call_id: str) -> str:
    """The dex tool-call id of a model's call in step ``position`` of a durable turn. The step
    is part of it because fake models reuse call ids from one response to the next; both
    come from the journaled response, so a replay gives the same keys."""
    return fit_id(f"{position}.{tool_call_id}")


def input_text(prompt: object, messages: Sequence[ModelMessage]) -> str:
    """The input that begins (or continues) a run's turn: the run's user prompt, else the last
    user prompt of the history it resumes."""
    if prompt is None:
        for message in reversed(messages):
            if isinstance(message, ModelRequest) and _begins_turn(message):
                parts = [p for p in message.parts if isinstance(p, UserPromptPart)]
                if parts:
                    prompt = parts[-1].content
                    break
    if prompt is None:
        raise DexError("a durable turn needs an input: the run has no user prompt and its "
                       "message history none either")
    if isinstance(prompt, str):
        return prompt
    return json.dumps(to_jsonable_python(prompt), sort_keys=True)


def dump_response(response: ModelResponse) -> str:
    return ModelMessagesTypeAdapter.dump_json([response]).decode()


def load_response(text: str) -> ModelResponse:
    [message] = ModelMessagesTypeAdapter.validate_json(text)
    if not isinstance(message, ModelResponse):
        raise DexError("a journaled step holds no Pydantic AI model response")
    return message


def text_of(response: ModelResponse) -> str | None:
    return response.text or None


def answer_text(output: object) -> str:
    if isinstance(output, str) and output.strip():
        return output
    return json.dumps(to_jsonable_python(output), sort_keys=True)


@dataclass
class Journal:
    """One run's durable turn: where its steps go, and the calls of the latest step."""

    session_id: str
    turn: Turn
    # The records of the latest step's calls, by the model's tool-call id.
    records: dict[str, ToolCallRecord] = field(default_factory=dict)
    # A response without tool calls, journaled only if the run asks the model again (a retry):
    # the final answer is the turn's end instead (end_turn), not a step.
    held: tuple[int, ModelResponse] | None = None
