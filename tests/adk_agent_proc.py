"""An ADK agent process for the kill test of the Google ADK adapter: a resumable app whose
offline model charges a card (a slow single-attempt write, no approval), then reports.

    python -m tests.adk_agent_proc SESSIONS_DB SESSION_ID start    # run, print the report
    python -m tests.adk_agent_proc SESSIONS_DB SESSION_ID resume   # resume the last invocation

Uses the ``DEX_*`` settings of the environment.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncGenerator

from google.adk.agents import LlmAgent
from google.adk.apps.app import App, ResumabilityConfig
from google.adk.models.base_llm import BaseLlm
from google.adk.models.llm_request import LlmRequest
from google.adk.models.llm_response import LlmResponse
from google.adk.runners import Runner
from google.adk.sessions.sqlite_session_service import SqliteSessionService
from google.genai import types

from dex_tasks import DexClient
from dex_tasks.integrations.google_adk import dex_adk_tools

APP, USER = "dex-charges", "customer-1"


class ChargeLlm(BaseLlm):
    """Charges once, then says what the charge tool returned."""

    async def generate_content_async(self, llm_request: LlmRequest, stream: bool = False
                                     ) -> AsyncGenerator[LlmResponse, None]:
        seen = {part.function_response.name: part.function_response.response
                for content in llm_request.contents for part in content.parts or []
                if part.function_response is not None}
        if "charge_card" in seen:
            part = types.Part(text="charge said: " + json.dumps(seen["charge_card"]))
        else:
            part = types.Part(function_call=types.FunctionCall(
                name="charge_card", id="call_charge",
                args={"customer_id": "cu_1", "amount_cents": 500, "sleep": 3.0}))
        yield LlmResponse(content=types.Content(role="model", parts=[part]))


async def main(sessions: str, session_id: str, mode: str) -> None:
    with DexClient.from_env() as client:
        agent = LlmAgent(name="billing", model=ChargeLlm(model="scripted"),
                         tools=dex_adk_tools(client, ["charge_card"]))
        app = App(name=APP, root_agent=agent,
                  resumability_config=ResumabilityConfig(is_resumable=True))
        service = SqliteSessionService(sessions)
        runner = Runner(app=app, session_service=service)
        invocation, message = None, None
        if mode == "start":
            await service.create_session(app_name=APP, user_id=USER, session_id=session_id)
            message = types.Content(role="user", parts=[types.Part(text="Charge me.")])
        else:
            session = await service.get_session(app_name=APP, user_id=USER,
                                                session_id=session_id)
            assert session is not None
            invocation = session.events[-1].invocation_id
        async for event in runner.run_async(user_id=USER, session_id=session_id,
                                            invocation_id=invocation, new_message=message):
            for part in (event.content.parts or []) if event.content else []:
                if part.text and event.author == agent.name:
                    print(part.text, flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
