"""What the journal of durable turns adds per tool call (issue 18), through the Pydantic AI
adapter: one agent run = one turn whose model makes one no-op tool call, then answers.

* ``journal``: ``DexCapability(client, session_id=...)``, a durable turn (``begin_turn``, the
  response journaled with its call by ``record_step``, ``end_turn``);
* ``plain``: ``DexCapability(client)`` keyed by the conversation id (``call_tool``), no journal.

Runs alternate (plain, journal, plain, ...) so drift in the machine's load falls on both; the
clock is the caller's around the whole ``agent.run``. Reported, not asserted::

    python -m bench.durable_turns --calls 50 --store sqlite
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from bench.infra import (
    READ_TOOL,
    TOOLS_MODULE,
    WorkerProcess,
    bench_session,
    child_env,
    fresh_store,
    median,
    postgres_admin_url,
    wait_for_catalog,
)
from dex_tasks import DexClient, DexSettings
from dex_tasks.integrations.pydantic_ai import DexCapability
from dex_tasks.ops.procutil import dex_command


def _model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    if len(messages) == 1:
        return ModelResponse(parts=[ToolCallPart(READ_TOOL, {},
                                                 tool_call_id=f"call_{uuid.uuid4().hex}")])
    return ModelResponse(parts=[TextPart("done")])


async def _runs(client: DexClient, calls: int) -> dict[str, list[float]]:
    agent = Agent(FunctionModel(_model))
    times: dict[str, list[float]] = {"plain": [], "journal": []}
    for n in range(calls + 2):  # the first two warm up
        for variant in (("plain", "journal") if n % 2 else ("journal", "plain")):
            session = f"bench-{variant}-{uuid.uuid4().hex[:8]}"
            dex = (DexCapability(client, session_id=session) if variant == "journal"
                   else DexCapability(client))
            start = time.perf_counter()
            result = await agent.run("go", capabilities=[dex], conversation_id=session)
            elapsed = time.perf_counter() - start
            assert result.output == "done"
            if n >= 2:
                times[variant].append(elapsed)
    return times


def run(calls: int, store: str, postgres_url: str | None) -> None:
    with bench_session("turns", [store], postgres_url) as (redis_server, _, workdir), \
            fresh_store(store, postgres_url, workdir) as url:
        env = {"DEX_REDIS_URL": redis_server.url(1), "DEX_DATABASE_URL": url}
        worker = WorkerProcess.start(
            "dex-tasks", [*dex_command(), "worker", "--tools", TOOLS_MODULE, "-c", "2"],
            child_env(env), workdir / "worker.log")
        try:
            with DexClient(DexSettings(redis_url=env["DEX_REDIS_URL"],
                                       database_url=url)) as client:
                wait_for_catalog(client, READ_TOOL, worker.check_alive)
                times = asyncio.run(_runs(client, calls))
        finally:
            worker.stop()
    plain, journal = median(times["plain"]) * 1000, median(times["journal"]) * 1000
    print(f"store={store} calls={calls} load={os.getloadavg()[0]:.1f}")
    print(f"  median agent run with one no-op tool call, plain:   {plain:7.2f} ms")
    print(f"  median agent run with one no-op tool call, journal: {journal:7.2f} ms")
    print(f"  added by the journal per tool call (median):        {journal - plain:7.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--store", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--postgres-url", default=None)
    args = parser.parse_args()
    run(args.calls, args.store, postgres_admin_url(args.postgres_url))


if __name__ == "__main__":
    main()
