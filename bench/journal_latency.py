"""The durable-turn journal's cost per tool call, for the OpenAI Agents SDK adapter.

    python -m bench.journal_latency [--runs 50] [--store sqlite|postgres] [--postgres-url URL]

One agent run = one model response calling the no-op read (``bench_noop_read``) on a worker,
then an answer. Two variants, interleaved run by run: ``Runner.run`` with
``dex_run_config(client)`` (the turn begun, the response journaled with its call, the answer
ending the turn) and without it (``dex_context`` with a fresh turn id, the call made by the
tool alone). The model is the SDK's ``ScriptedModel`` (no network), so the difference of the
medians is what the journal adds to one tool call. Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from agents import Agent, Runner, set_tracing_disabled
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

from bench.infra import (
    READ_TOOL,
    TOOLS_MODULE,
    RedisServer,
    WorkerProcess,
    child_env,
    fresh_store,
    median,
    percentile,
)
from dex_tasks import DexClient, DexSettings
from dex_tasks.integrations.openai_agents import dex_context, dex_function_tools, dex_run_config
from dex_tasks.ops.procutil import dex_command


def model() -> ScriptedModel:
    return ScriptedModel([
        ModelStep.respond(lambda call: [function_call(READ_TOOL, {},
                                                      call_id=f"c{uuid.uuid4().hex[:8]}")]),
        ModelStep.respond(lambda call: [assistant_message("done")]),
    ])


async def one_run(client: DexClient, journaled: bool) -> float:
    agent = Agent(name="bench", tools=dex_function_tools(client, [READ_TOOL]), model=model())
    session = f"bench-{uuid.uuid4().hex[:10]}"
    start = time.perf_counter()
    if journaled:
        await Runner.run(agent, "go", context=dex_context(session, client=client),
                         run_config=dex_run_config(client))
    else:
        await Runner.run(agent, "go", context=dex_context(session))
    return time.perf_counter() - start


async def measure(client: DexClient, runs: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"with journal": [], "without": []}
    for _ in range(3):  # warm up both paths (imports, connections, the worker's first call)
        await one_run(client, True)
        await one_run(client, False)
    for i in range(runs):
        for journaled in ((True, False) if i % 2 else (False, True)):
            elapsed = await one_run(client, journaled)
            times["with journal" if journaled else "without"].append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--postgres-url", default=os.environ.get("DEX_TEST_POSTGRES_URL"))
    args = parser.parse_args()
    set_tracing_disabled(True)
    redis_server = RedisServer().start()
    workdir = Path(tempfile.mkdtemp(prefix="dex-bench-journal-"))
    try:
        with fresh_store(args.store, args.postgres_url, workdir) as database_url:
            env = {"DEX_REDIS_URL": redis_server.url(), "DEX_DATABASE_URL": database_url}
            worker = WorkerProcess.start(
                "noop", [*dex_command(), "worker", "--tools", TOOLS_MODULE, "-c", "2"],
                child_env(env), workdir / "worker.log")
            try:
                worker.wait_children(2)
                with DexClient(DexSettings(redis_url=redis_server.url(),
                                           database_url=database_url)) as client:
                    times = asyncio.run(measure(client, args.runs))
            finally:
                worker.stop()
    finally:
        redis_server.stop()
    for name, values in times.items():
        print(f"{name:>13}: p50 {median(values) * 1000:7.2f} ms   "
              f"p90 {percentile(values, 90) * 1000:7.2f} ms   (n={len(values)})")
    added = median(times["with journal"]) - median(times["without"])
    print(f"journal adds {added * 1000:.2f} ms per tool call (difference of the medians, "
          f"store {args.store})")


if __name__ == "__main__":
    try:
        main()
    except subprocess.SubprocessError as err:  # pragma: no cover - a benchmark's own failure
        sys.exit(f"journal_latency: {err}")
