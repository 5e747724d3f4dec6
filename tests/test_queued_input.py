"""Another input while a session's turn is open is queued, and answered after that turn ended
(issue 28, item 5; DESIGN, "Durable turns": "A different input on a session whose turn is
still open is queued as a user message, not started as a second turn", delivered when it ends).

The story, per adapter, with the framework's own fake model, offline, against a real worker:
the user asks for a refund (A), which waits for a person; meanwhile the user asks something
else (B). B is queued in the session (its snapshot says so); the model is not asked about B
inside the refund's turn, the refund's journaled decisions are not replayed as if B had made
them, and its pending approval is not presented as B's. A person approves; the refund's turn
goes on the adapter's usual way and ends, the refund having run once; B is delivered then, the
model reads it after the refund's answer, and the session holds B once.

Before: the OpenAI Agents adapter replayed A's journaled model responses for B and surfaced
A's approval as B's (with ``dex_context(session, client=...)`` it raised ``TurnConflictError``);
Pydantic AI raised, and B, once delivered, was stored a second time when run; CrewAI ran a
later task unjournaled beside the open one; LangGraph dropped the pending approval and asked
the model about B after an unanswered tool call.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest
from agents import Agent as OpenAIAgent
from agents import Runner, set_tracing_disabled
from agents.items import TResponseOutputItem
from agents.testing import ModelCall, ModelStep, ScriptedModel, assistant_message, function_call
from crewai import Crew, Task
from google.adk.agents import LlmAgent
from google.adk.apps import App
from google.adk.models.base_llm import BaseLlm
from google.adk.models.llm_request import LlmRequest
from google.adk.models.llm_response import LlmResponse
from google.adk.runners import Runner as AdkRunner
from google.adk.sessions import InMemorySessionService
from google.genai import types
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import DeferredToolRequests
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from dex_tasks import DexClient, MessageRole
from dex_tasks.integrations import openai_agents as oa
from dex_tasks.integrations import pydantic_ai as pyd
from dex_tasks.integrations.crewai import WAITING_TASK
from dex_tasks.integrations.google_adk import DexAdkPlugin, dex_adk_tools, dex_confirmations
from dex_tasks.integrations.langchain import (
    DEX_APPROVAL,
    DexCheckpointer,
    DexMiddleware,
    dex_tools,
    resume_command,
)
from tests.conftest import StartWorker
from tests.helpers import ROOT, load_module
from tests.langchain_agent_proc import ScriptedChatModel, ai
from workers import ledger

set_tracing_disabled(True)

A = "Refund charge ch_1, 500 cents."
B = "Where is order 1002?"
REFUND = {"charge_id": "ch_1", "amount_cents": 500}


@pytest.fixture
def worker(start_worker: StartWorker) -> None:
    start_worker(concurrency=2)


def user_messages(client: DexClient, session: str) -> list[tuple[str | None, str | None]]:
    return [(m.text, m.status) for m in client.get_agent_snapshot(session).messages
            if m.role is MessageRole.USER]


def approve_the_refund(client: DexClient, session: str) -> None:
    [pending] = client.get_agent_snapshot(session).pending_interrupts
    assert pending.tool == "refund_payment"
    assert client.resolve_interrupt(session, pending.interrupt_id, True, approver="alice")


def refunds(ledger_path: Path) -> int:
    return sum(1 for entry in ledger.read(ledger_path) if entry["tool"] == "refund_payment")


# -- OpenAI Agents SDK -------------------------------------------------------------------------


def openai_model(asked: list[str]) -> ScriptedModel:
    """Refunds for A (then reports the refund), answers B in words; logs each request's
    latest user message."""

    def respond(call: ModelCall) -> list[TResponseOutputItem]:
        users = [item.get("content") for item in call.input
                 if isinstance(item, dict) and item.get("role") == "user"]
        asked.append(str(users[-1]))
        outputs = [item for item in call.input
                   if isinstance(item, dict) and item.get("type") == "function_call_output"]
        if users[-1] == B:
            return [assistant_message("Order 1002 is being packed.")]
        if not outputs:
            return [function_call("refund_payment", REFUND, call_id="call_refund")]
        return [assistant_message(f"refund said: {outputs[-1]['output']}")]

    return ScriptedModel([ModelStep.respond(respond) for _ in range(6)])


def test_openai_agents_queues_another_input_and_answers_it_after_the_turn(
    client: DexClient, worker: None, ledger_path: Path,
) -> None:
    asked: list[str] = []
    agent = OpenAIAgent(name="support", model=openai_model(asked),
                        tools=oa.dex_function_tools(client, ["refund_payment"]))

    async def run(text: str) -> Any:
        return await Runner.run(agent, text, context=oa.dex_context("s-oa", client=client),
                                run_config=oa.dex_run_config(client))

    # Given a turn paused on the refund's approval
    first = asyncio.run(run(A))
    state = first.to_state()
    assert asyncio.run(oa.apply_dex_decisions(state, client))  # undecided
    assert asked == [A]
    # When another input arrives (dex_context finds the open turn, as after a restart)
    with pytest.raises(oa.TurnInProgressError, match="queued") as waiting:
        asyncio.run(run(B))
    # Then it is queued; the model was not asked, nothing was replayed for it
    assert waiting.value.turn.input == A and asked == [A]
    assert user_messages(client, "s-oa") == [(A, "delivered"), (B, "queued")]
    assert len(client.get_agent_snapshot("s-oa").pending_interrupts) == 1

    # When a person approves and the paused run is resumed, the usual way
    approve_the_refund(client, "s-oa")
    assert asyncio.run(oa.apply_dex_decisions(state, client)) == []
    done = asyncio.run(Runner.run(agent, state, run_config=oa.dex_run_config(client)))
    assert str(done.final_output).startswith("refund said: ")
    # Then the refund ran once, its turn ended, and B was delivered after its answer
    assert refunds(ledger_path) == 1 and client.open_turn("s-oa") is None
    assert user_messages(client, "s-oa") == [(A, "delivered"), (B, "delivered")]
    # And B run again (the same code) is answered: the model reads it, the session holds it once
    answer = asyncio.run(run(B))
    assert answer.final_output == "Order 1002 is being packed." and asked[-1] == B
    assert user_messages(client, "s-oa") == [(A, "delivered"), (B, "delivered")]
    texts = [m.text for m in client.get_agent_snapshot("s-oa").messages
             if m.role is not MessageRole.TOOL]
    assert texts == [A, None, texts[2], B, "Order 1002 is being packed."]
    assert texts[2] is not None and texts[2].startswith("refund said: ")
    assert refunds(ledger_path) == 1


# -- Pydantic AI -------------------------------------------------------------------------------


def pydantic_model(asked: list[str]) -> FunctionModel:
    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        prompts = [p.content for m in messages if isinstance(m, ModelRequest)
                   for p in m.parts if isinstance(p, UserPromptPart)]
        asked.append(str(prompts[-1]))
        returns = [p for m in messages if isinstance(m, ModelRequest) for p in m.parts
                   if isinstance(p, ToolReturnPart)]
        if prompts[-1] == B:
            return ModelResponse(parts=[TextPart("Order 1002 is being packed.")])
        if not returns:
            return ModelResponse(parts=[ToolCallPart("refund_payment", REFUND, "call_refund")])
        return ModelResponse(parts=[TextPart(f"refund said: {returns[-1].content}")])

    return FunctionModel(respond)


def test_pydantic_ai_queues_another_input_and_answers_it_after_the_turn(
    client: DexClient, worker: None, ledger_path: Path,
) -> None:
    asked: list[str] = []
    agent = PydanticAgent(pydantic_model(asked), output_type=[str, DeferredToolRequests])

    def run(text: str) -> Any:
        dex = pyd.DexCapability(client, session_id="s-pyd")
        return asyncio.run(agent.run(text, capabilities=[dex])).output

    # Given a turn paused on the refund's approval
    assert isinstance(run(A), DeferredToolRequests)
    # When another input arrives: queued, the model not asked
    with pytest.raises(pyd.TurnInProgressError, match="queued"):
        run(B)
    assert asked == [A] and user_messages(client, "s-pyd") == [(A, "delivered"), (B, "queued")]
    # When a person approves and the turn is run again, the usual way: the refund runs once
    approve_the_refund(client, "s-pyd")
    assert str(run(A)).startswith("refund said: ")
    assert refunds(ledger_path) == 1
    assert user_messages(client, "s-pyd") == [(A, "delivered"), (B, "delivered")]
    # And B run again is answered, and held once
    assert run(B) == "Order 1002 is being packed." and asked[-1] == B
    assert user_messages(client, "s-pyd") == [(A, "delivered"), (B, "delivered")]
    assert refunds(ledger_path) == 1


# -- CrewAI ------------------------------------------------------------------------------------


def test_crewai_queues_a_later_task_behind_an_open_turn_and_runs_it_journaled_later(
    client: DexClient, worker: None, ledger_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    example = load_module(ROOT / "examples" / "crewai_agent.py", "crewai_agent")

    def crew() -> Crew:
        base = example.build_crew(client, "s-crew", "1001")
        (agent,) = base.agents
        later = Task(description="Refund order 1001 again.", expected_output="The outcome.",
                     agent=agent)
        return Crew(agents=[agent], tasks=[*base.tasks, later])

    # Given a crew whose first task's refund waits for a person
    first = crew()
    assert example.run_crew(client, first, "s-crew") == 3
    # Then the second task did not start: its model was not asked, its input is queued, and
    # its answer says it waits; only the first task's refund is held
    assert first.agents[0].llm._inner.asked == 3  # lookup, refund, the first task's answer
    assert first.tasks[1].output is not None
    assert str(first.tasks[1].output.raw).startswith(WAITING_TASK)
    assert user_messages(client, "s-crew") == [("Refund order 1001.", "delivered"),
                                               ("Refund order 1001 again.", "queued")]
    assert len(client.get_agent_snapshot("s-crew").pending_interrupts) == 1

    # When a person approves and the crew runs again
    approve_the_refund(client, "s-crew")
    again = crew()
    assert example.run_crew(client, again, "s-crew") == 0
    # Then the first refund ran once; the second task ran, journaled (its model's decisions
    # and its answer in its own turn), that turn begun from the queued input, held once
    # (CrewAI's own tool cache answered its calls, identical to the first task's)
    assert refunds(ledger_path) == 1
    assert user_messages(client, "s-crew") == [("Refund order 1001.", "delivered"),
                                               ("Refund order 1001 again.", "delivered")]
    later_turn = next(m for m in client.get_agent_snapshot("s-crew").messages
                      if m.text == "Refund order 1001 again.").turn_id
    steps = [m for m in client.get_agent_snapshot("s-crew").messages
             if m.turn_id == later_turn and m.role is MessageRole.ASSISTANT]
    assert len(steps) == 3 and client.open_turn("s-crew") is None
    assert str(again.tasks[1].output.raw).startswith("refund tool said: ")
    capsys.readouterr()


# -- LangGraph ---------------------------------------------------------------------------------


def test_langgraph_holds_another_input_until_the_turn_ends(
    client: DexClient, worker: None, ledger_path: Path,
) -> None:
    model = ScriptedChatModel(messages=iter([
        ai(("refund_payment", REFUND, "call_refund")),
        AIMessage("The refund went through."),
        AIMessage("Order 1002 is being packed."),
    ]))
    agent = create_agent(model, tools=dex_tools(client, ["refund_payment"]),
                         middleware=[DexMiddleware(client)],
                         checkpointer=DexCheckpointer(client))
    config: Any = {"configurable": {"thread_id": "s-lg"}}

    def pending() -> list[Any]:
        return [i.value for i in agent.get_state(config).interrupts
                if i.value.get("type") == DEX_APPROVAL]

    # Given a graph paused on the refund's approval
    agent.invoke({"messages": [HumanMessage(A)]}, config, durability="sync")
    [approval] = pending()
    # When another input arrives (LangGraph itself would drop the pause and answer it)
    agent.invoke({"messages": [HumanMessage(B)]}, config, durability="sync")
    # Then the graph is paused on the same approval, the model was not asked, and the new
    # input is held out of what it reads, queued in the session
    assert pending() == [approval] and len(model.received) == 1
    values = agent.get_state(config).values
    assert [m.content for m in values["messages"] if isinstance(m, HumanMessage)] == [A]
    assert [m.content for m in values["dex_queued"]] == [B]
    assert user_messages(client, "s-lg") == [(B, "queued")]

    # When a person approves and the graph resumes, LangGraph's way
    approve_the_refund(client, "s-lg")
    done = agent.invoke(resume_command(agent.get_state(config)), config, durability="sync")
    # Then the refund ran once and the model answered it; then it read B, after that answer
    assert refunds(ledger_path) == 1
    contents = [m.content for m in done["messages"] if not m.type == "tool"]
    assert contents == [A, "", "The refund went through.", B, "Order 1002 is being packed."]
    assert [m.content for m in model.received[-1]][-2:] == ["The refund went through.", B]
    assert user_messages(client, "s-lg") == [(B, "delivered")]
    assert not agent.get_state(config).values.get("dex_queued")


# -- Google ADK --------------------------------------------------------------------------------


class AdkModel(BaseLlm):
    """Refunds for A, then reports the refund; answers B in words. ``asked`` logs the latest
    user text each request showed the model, ``seen`` every text it showed."""

    asked: list[str] = []
    seen: list[list[str]] = []

    async def generate_content_async(self, llm_request: LlmRequest, stream: bool = False
                                     ) -> AsyncGenerator[LlmResponse, None]:
        texts = [p.text for c in llm_request.contents if c.role == "user"
                 for p in c.parts or [] if p.text and not p.thought]
        self.asked.append(texts[-1])
        self.seen.append(texts)
        done = [p.function_response.response for c in llm_request.contents
                for p in c.parts or []
                if p.function_response is not None and p.function_response.name
                == "refund_payment"]
        if texts[-1] == B:
            part = types.Part(text="Order 1002 is being packed.")
        elif not done:
            part = types.Part(function_call=types.FunctionCall(
                name="refund_payment", args=REFUND, id="call_refund"))
        else:
            part = types.Part(text="refund said: " + json.dumps(done[-1]))
        yield LlmResponse(content=types.Content(role="model", parts=[part]))


def test_google_adk_holds_another_message_until_the_turn_ends(
    client: DexClient, worker: None, ledger_path: Path,
) -> None:
    model = AdkModel(model="scripted", asked=[], seen=[])
    agent = LlmAgent(name="support", model=model,
                     tools=dex_adk_tools(client, ["refund_payment"]))
    service = InMemorySessionService()
    runner = AdkRunner(app=App(name="shop", root_agent=agent, plugins=[DexAdkPlugin(client)]),
                       session_service=service)

    async def send(message: types.Content) -> list[str]:
        said = []
        async for event in runner.run_async(user_id="u", session_id="s-adk",
                                            new_message=message):
            said += [p.text for p in (event.content.parts or []) if event.content and p.text]
        return said

    def text(value: str) -> types.Content:
        return types.Content(role="user", parts=[types.Part(text=value)])

    async def story() -> None:
        await service.create_session(app_name="shop", user_id="u", session_id="s-adk")
        # Given a turn whose refund waits for a person (ADK's tool confirmation)
        await send(text(A))
        assert model.asked == [A]
        # When another message arrives: held; the model is not asked; queued in dex-tasks
        said = await send(text(B))
        assert model.asked == [A] and any("queued" in s for s in said)
        assert user_messages(client, "s-adk") == [(B, "queued")]
        # When a person approves and the confirmation is answered, ADK's way
        approve_the_refund(client, "s-adk")
        session = await service.get_session(app_name="shop", user_id="u", session_id="s-adk")
        assert session is not None
        answer = await dex_confirmations(client, session)
        assert answer is not None
        said = await send(answer)
        # Then the refund ran once; its turn went on without B in what the model read
        assert refunds(ledger_path) == 1 and said[-1].startswith("refund said: ")
        assert all(B not in seen for seen in model.seen)
        assert user_messages(client, "s-adk") == [(B, "delivered")]
        # And B sent again is answered after the refund's answer
        said = await send(text(B))
        assert said[-1] == "Order 1002 is being packed." and model.seen[-1] == [A, B]
        assert refunds(ledger_path) == 1

    asyncio.run(story())
