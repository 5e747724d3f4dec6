"""The README's framework sections run as pasted (issue 18, item 5): each fenced Python block
under "### LangChain / LangGraph" and "### OpenAI Agents SDK" is run against a real worker,
with ``model`` (the one name the README leaves to the reader: "your model") bound to that
framework's own fake model, which looks order 1001 up and answers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from agents import set_tracing_disabled
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call
from langchain_core.messages import AIMessage

from dex_tasks import DexSettings
from tests.conftest import StartWorker, settings_env
from tests.helpers import ROOT
from tests.langchain_agent_proc import ScriptedChatModel, ai
from workers import ledger


def section_blocks(heading: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n#", start + len(heading) + 2)
    return re.findall(r"```python\n(.*?)```", text[start:end], re.S)


def langchain_model() -> Any:
    return ScriptedChatModel(messages=iter([ai(("lookup_order", {"order_id": "1001"}, "c1")),
                                            AIMessage("Order 1001 has shipped.")]))


def openai_model() -> Any:
    set_tracing_disabled(True)
    return ScriptedModel([
        ModelStep.respond(lambda call: [function_call("lookup_order", {"order_id": "1001"},
                                                      call_id="c1")]),
        ModelStep.respond(lambda call: [assistant_message("Order 1001 has shipped.")])])


@pytest.mark.parametrize(("heading", "model"), [
    ("### LangChain / LangGraph", langchain_model), ("### OpenAI Agents SDK", openai_model)])
def test_each_framework_section_of_the_readme_runs_as_pasted(
    heading: str, model: Any, settings: DexSettings, start_worker: StartWorker,
    ledger_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    start_worker()
    for name, value in settings_env(settings, ledger_path).items():
        if name.startswith("DEX_"):
            monkeypatch.setenv(name, value)
    (block,) = section_blocks(heading)
    namespace: dict[str, Any] = {"model": model(), "__name__": "readme"}
    exec(compile(block, f"README.md {heading}", "exec"), namespace)
    namespace["client"].close()
    runs = ledger.executions(ledger_path)
    assert [key.rsplit("/", 1)[1] for key in runs] == ["c1"] and list(runs.values()) == [1]
