"""The classes the client's public annotations name, imported when an annotation is evaluated.

The client's modules defer their heavy imports (``dex_tasks.lazy``): until the first client is
built their names are stand-ins, and ``typing.get_type_hints`` reads a module's namespace as
it is, so an annotation naming a stand-in evaluated to ``_StandIn | None`` (or failed). FastAPI
dependencies, pydantic's ``validate_call`` and doc tools read annotations that way. So the
annotations name their classes through this module (``settings: hints.DexSettings | None``),
whose ``__getattr__`` (PEP 562, as the package's own public names) imports the real class
when the annotation is evaluated, whatever was imported before; importing this module imports
nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dex_tasks.lazy import module_attributes

if TYPE_CHECKING:
    from celery import Celery as Celery

    from dex_tasks.broker.notify import CallWatcher as CallWatcher
    from dex_tasks.settings import DexSettings as DexSettings
    from dex_tasks.store import Store as Store
    from dex_tasks.store.catalog import ToolSpec as ToolSpec
    from dex_tasks.store.checkpoints import Checkpoints as Checkpoints
    from dex_tasks.store.records import AgentSnapshot as AgentSnapshot
    from dex_tasks.store.records import CallEvent as CallEvent
    from dex_tasks.store.records import SessionMessage as SessionMessage
    from dex_tasks.store.records import ToolCallRecord as ToolCallRecord
    from dex_tasks.store.records import Turn as Turn

_DEFINED_IN: dict[str, str] = {
    "Celery": "celery",
    "CallWatcher": "dex_tasks.broker.notify",
    "DexSettings": "dex_tasks.settings",
    "Store": "dex_tasks.store",
    "ToolSpec": "dex_tasks.store.catalog",
    "Checkpoints": "dex_tasks.store.checkpoints",
    "AgentSnapshot": "dex_tasks.store.records",
    "CallEvent": "dex_tasks.store.records",
    "SessionMessage": "dex_tasks.store.records",
    "ToolCallRecord": "dex_tasks.store.records",
    "Turn": "dex_tasks.store.records",
}


__getattr__, __dir__ = module_attributes(__name__, globals(), _DEFINED_IN)
