"""Imports deferred to first use, for modules an agent process loads before it needs them.

``from dex_tasks import DexClient`` should not pay for Celery and SQLAlchemy (over a second on
a loaded machine) before the client is built. A module that wants that writes its heavy imports
twice, side by side: once as real import statements under ``if TYPE_CHECKING:`` (what mypy, the
import-graph check and ``tests/test_layout.py`` read), and once as a :class:`Deferred` group
binding the same names at run time::

    if TYPE_CHECKING:
        from dex_tasks.store import Store, catalog
    else:
        _deferred = Deferred(globals())
        Store, catalog = _deferred("dex_tasks.store", "Store", "catalog")

Each name starts as a stand-in. The first use of any stand-in of a group (a call, an
attribute, an ``isinstance``) imports every module of the group and puts the real objects in
the module's namespace, so later uses cost nothing; a name already replaced meanwhile (a test's
``monkeypatch.setattr``) is left alone. ``tests/test_packaging.py`` checks that each group binds
exactly what its ``TYPE_CHECKING`` block imports.

Stand-ins are for code, never for annotations: ``typing.get_type_hints`` reads a module's
namespace as it is, and would meet a stand-in (``_StandIn | None``) until the group loaded.
The client's public annotations name their classes through ``dex_tasks.agent.hints`` instead
(``settings: hints.DexSettings | None``), whose ``__getattr__`` (PEP 562) imports the real
class when the annotation is evaluated, whatever was imported before.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any


class Deferred:
    """A group of deferred imports into one module's namespace (its ``globals()``)."""

    def __init__(self, namespace: MutableMapping[str, Any]) -> None:
        self._namespace = namespace
        self._wanted: list[tuple[str, str]] = []  # (module, name)
        self._stand_ins: dict[str, _StandIn] = {}
        self._lock = threading.Lock()
        self._loaded = False

    def __call__(self, module: str, *names: str) -> Any:
        """Stand-ins for ``from module import *names``: one object, or a tuple of them."""
        made = []
        for name in names:
            self._wanted.append((module, name))
            made.append(self._stand_ins.setdefault(name, _StandIn(self, name)))
        return made[0] if len(made) == 1 else tuple(made)

    @property
    def names(self) -> dict[str, str]:
        """Each deferred name and the module it comes from (for the tests)."""
        return {name: module for module, name in self._wanted}

    def load(self) -> None:
        """Import the group now and put the real objects in the namespace."""
        with self._lock:
            if self._loaded:
                return
            for module, name in self._wanted:
                value = _attribute(module, name)
                self._stand_ins[name].__dict__["_value"] = value
                if self._namespace.get(name) is self._stand_ins[name]:
                    self._namespace[name] = value
            self._loaded = True


def module_attributes(
    module_name: str, namespace: MutableMapping[str, Any], defined_in: Mapping[str, str],
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module's PEP 562 ``__getattr__`` and ``__dir__`` for the names ``defined_in`` maps to
    the modules they come from: the first lookup of one imports its module and binds the name
    in ``namespace`` (the module's ``globals()``), so the next is an ordinary attribute. The
    package root's public names and ``agent.hints``' annotation names are looked up so."""

    def __getattr__(name: str) -> Any:
        module = defined_in.get(name)
        if module is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(defined_in))

    return __getattr__, __dir__


def _attribute(module: str, name: str) -> Any:
    imported = importlib.import_module(module)
    try:
        return getattr(imported, name)
    except AttributeError:  # a submodule not imported by its package: from package import sub
        return importlib.import_module(f"{module}.{name}")


class _StandIn:
    """What a deferred name holds until its group is loaded; delegates to the real object."""

    def __init__(self, group: Deferred, name: str) -> None:
        self.__dict__["_group"] = group
        self.__dict__["_name"] = name

    def _real(self) -> Any:
        if "_value" not in self.__dict__:
            self.__dict__["_group"].load()
        return self.__dict__["_value"]

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._real(), attribute)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._real()(*args, **kwargs)

    def __instancecheck__(self, instance: Any) -> bool:
        return isinstance(instance, self._real())

    def __subclasscheck__(self, subclass: Any) -> bool:
        return issubclass(subclass, self._real())

    def __repr__(self) -> str:
        name = self.__dict__["_name"]
        if "_value" in self.__dict__:
            return repr(self.__dict__["_value"])
        return f"<deferred import of {name}>"
