"""A Pydantic AI agent process for ``test_durable_turns_pydantic_ai.py``, killed where it is told.

``python -m tests.pydantic_durable_agent SESSION TOOL ARGS_JSON MODEL_LOG KILL_AT``: one run of
``agent.run("please do it", capabilities=[DexCapability(client, session_id=SESSION)])``, the
restart idiom itself, with Pydantic AI's own ``FunctionModel`` as the model. Its first decision
calls ``TOOL`` with a fresh tool-call id each time it is asked (as a real model mints new ids);
its second answers with the tool's result. Each time it is asked, and each time it answers, it
appends a line to ``MODEL_LOG``, so the test counts the model's decisions across processes.

``KILL_AT`` is where this process SIGKILLs itself (or ``none``; ``tool`` and ``approval`` are
killed by the test: while the tool runs, and while the run is paused on an approval):

* ``model``: asked, before it answered;
* ``dispatch``: after the step and its call were journaled, before the call was sent;
* ``after_tool``: after the call ended, before the model read its result.

At the end it prints ``{"output": ...}``, or ``paused`` when the run waits for an approval (and
then waits to be killed, as a server holding the run would).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid
from typing import Any

from pydantic_ai import Agent, DeferredToolRequests
from pydantic_ai.messages import ModelMessage, ModelRequest, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

import dex_tasks.agent.client as client_module
from dex_tasks import AsyncDexClient, DexClient, ToolCallRecord
from dex_tasks.integrations.pydantic_ai import DexCapability
from workers import ledger

SESSION, TOOL, ARGS, MODEL_LOG, KILL_AT = sys.argv[1:6]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def log(event: str, step: int) -> None:
    ledger.append(MODEL_LOG, {"pid": os.getpid(), "event": event, "step": step})


def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    step = sum(isinstance(m, ModelResponse) for m in messages)
    log("asked", step)
    if KILL_AT == "model":
        die()
    if step == 0:
        response = ModelResponse(parts=[ToolCallPart(TOOL, json.loads(ARGS),
                                                     tool_call_id=f"call_{uuid.uuid4().hex}")])
    else:
        last = messages[-1]
        assert isinstance(last, ModelRequest)
        response = ModelResponse(parts=[TextPart(f"done: {last.parts[0].content}")])
    log("answered", step)
    return response


if KILL_AT == "dispatch":
    def _die(*_args: Any, **_kwargs: Any) -> None:
        die()

    client_module.publish = client_module.publish_many = _die  # type: ignore[assignment]

if KILL_AT == "after_tool":
    _wait = AsyncDexClient.wait

    async def _wait_then_die(self: AsyncDexClient, key: str,
                             timeout: float = 30.0) -> ToolCallRecord:
        record = await _wait(self, key, timeout)
        if record.terminal:
            die()
        return record

    AsyncDexClient.wait = _wait_then_die  # type: ignore[method-assign]


async def main() -> None:
    with DexClient.from_env() as client:
        agent = Agent(FunctionModel(model), output_type=[str, DeferredToolRequests])
        dex = DexCapability(client, session_id=SESSION, timeout=60)
        result = await agent.run("please do it", capabilities=[dex])
        if isinstance(result.output, DeferredToolRequests):
            print("paused", flush=True)
            while True:
                time.sleep(1)
        print(json.dumps({"output": result.output}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
