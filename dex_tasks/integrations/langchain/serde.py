"""The serializer ``DexCheckpointer`` uses by default: LangGraph's msgpack, loading no type
the app has not declared.

LangGraph's own serializer (``JsonPlusSerializer``) stores an object as the module and name of
its class plus its data, and on loading imports that module and calls that name with the data.
Its default lets any name through (with a warning), so whoever can write to the checkpoint
tables can have ``os.system`` called, with an argument of their choosing, in every agent
process that resumes the thread: pickle's hazard under another name.

:class:`StrictSerializer` writes exactly what LangGraph writes (checkpoints stay readable by
LangGraph's own savers) but, before LangGraph's decoder sees a blob, walks it and refuses it
whole (:class:`UnsafeCheckpointError`, naming the type) if any object in it names a type
outside an allow-list: LangGraph's own safe types (messages, ``Send``, ``Interrupt``,
``Command``, dates, UUIDs, ...) and the types the app declares (``allowed_types``). The decoder
itself is LangGraph's, built with that same allow-list (no unlisted name is ever imported,
should the walk miss one), and the ``pickle`` and legacy ``json`` forms are refused. Writing a
value of an undeclared type fails at once, naming it, so that no checkpoint is stored that
could not be loaded back.
"""

from __future__ import annotations

from collections.abc import Iterable
from inspect import isclass
from typing import Any

import ormsgpack
from langgraph.checkpoint.serde._msgpack import (  # the allow-lists LangGraph ships
    SAFE_MSGPACK_METHODS,
    SAFE_MSGPACK_TYPES,
)
from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.jsonplus import (
    EXT_CONSTRUCTOR_KW_ARGS,
    EXT_CONSTRUCTOR_POS_ARGS,
    EXT_CONSTRUCTOR_SINGLE_ARG,
    EXT_DELTA_SNAPSHOT,
    EXT_METHOD_SINGLE_ARG,
    EXT_NUMPY_ARRAY,
    EXT_PYDANTIC_V1,
    EXT_PYDANTIC_V2,
    JsonPlusSerializer,
)

from dex_tasks import DexError, InvalidArgumentError

__all__ = ["StrictSerializer", "UnsafeCheckpointError"]

# The ext types whose payload is (module, name, data, ...): each names what it would call.
_NAMING = frozenset({EXT_CONSTRUCTOR_SINGLE_ARG, EXT_CONSTRUCTOR_POS_ARGS,
                     EXT_CONSTRUCTOR_KW_ARGS, EXT_METHOD_SINGLE_ARG, EXT_PYDANTIC_V1,
                     EXT_PYDANTIC_V2})
# Forms that carry no code: loaded as they are.
_PLAIN = frozenset({"null", "bytes", "bytearray"})


class UnsafeCheckpointError(DexError):
    """A checkpoint (or a pending write) names a type the checkpointer may not load, or is in
    a form it does not load (``pickle``, LangGraph's legacy ``json``).

    Nothing in it was imported or called. If the type is one of your graph's own state types,
    declare it: ``DexCheckpointer(client, allowed_types=[TheType])``; otherwise someone wrote
    to the checkpoint tables who should not have.
    """


def type_key(entry: type | tuple[str, ...] | Any) -> tuple[str, str]:
    """``(module, name)`` of a declared type: a class, or a ``(module, name)`` pair."""
    if isclass(entry):
        return (entry.__module__, entry.__name__)
    if (isinstance(entry, tuple) and len(entry) == 2
            and all(isinstance(part, str) and part for part in entry)):
        return (entry[0], entry[1])
    raise InvalidArgumentError(f"allowed_types must hold classes or (module, name) pairs of "
                               f"strings, got {entry!r}")


class StrictSerializer(SerializerProtocol):
    """LangGraph's serializer, limited to LangGraph's safe types and ``allowed_types``.

    ``allowed_types``: the app's own types that its graph state holds (a pydantic model or a
    dataclass in a state field), as classes or ``(module, name)`` pairs.
    """

    def __init__(self, allowed_types: Iterable[type | tuple[str, ...]] = ()) -> None:
        if isinstance(allowed_types, str | bytes):
            raise InvalidArgumentError(f"allowed_types must be a list of types, got "
                                       f"{allowed_types!r}")
        self.declared = frozenset(type_key(entry) for entry in allowed_types)
        self.allowed: frozenset[tuple[str, ...]] = SAFE_MSGPACK_TYPES | self.declared
        # LangGraph's decoder, strict too: with None it loads its safe types only.
        self._jsonplus = JsonPlusSerializer(
            allowed_msgpack_modules=sorted(self.declared) or None)

    def with_types(self, extra: Iterable[type | tuple[str, ...]]) -> StrictSerializer:
        """This serializer with more declared types (the same one if they add nothing)."""
        more = {type_key(entry) for entry in extra} - self.declared
        return self if not more else StrictSerializer(sorted(self.declared | more))

    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        """LangGraph's form of ``obj``; :class:`UnsafeCheckpointError` if it holds a value of
        a type this serializer would refuse to load."""
        type_, data = self._jsonplus.dumps_typed(obj)
        if type_ == "msgpack":
            self._check(data, writing=True)
        elif type_ not in _PLAIN:  # (never: LangGraph's encoder has no pickle fallback here)
            raise UnsafeCheckpointError(f"refused to store a {type_!r} checkpoint value")
        return type_, data

    def loads_typed(self, data: tuple[str, bytes]) -> Any:
        """The value, once every type it names is allowed; otherwise
        :class:`UnsafeCheckpointError`, with nothing imported or called."""
        type_, blob = data
        if type_ == "msgpack":
            self._check(blob, writing=False)
        elif type_ not in _PLAIN:
            raise UnsafeCheckpointError(
                f"refused to load a checkpoint value stored as {type_!r}: DexCheckpointer "
                "loads only LangGraph's msgpack form (pickle and the legacy json form can "
                "run code named in the stored data)")
        return self._jsonplus.loads_typed((type_, blob))

    def _check(self, blob: bytes, *, writing: bool) -> None:
        """Walk the blob's objects without building any; raise at the first refused name."""
        # ormsgpack replaces what an ext hook raises with ValueError("ext_hook failed"): the
        # refusal is kept here to be raised as itself.
        refused: list[UnsafeCheckpointError] = []

        def refuse(error: UnsafeCheckpointError) -> UnsafeCheckpointError:
            refused.append(error)
            return error

        def names(code: int, payload: bytes) -> None:
            if code in _NAMING:
                found = ormsgpack.unpackb(payload, ext_hook=names,
                                         option=ormsgpack.OPT_NON_STR_KEYS)
                if (not isinstance(found, list | tuple) or len(found) < 3
                        or not isinstance(found[0], str) or not isinstance(found[1], str)):
                    raise refuse(UnsafeCheckpointError(
                        "refused a checkpoint value: an object in it is malformed"))
                module, name = found[0], found[1]
                if code == EXT_METHOD_SINGLE_ARG:
                    method = found[3] if len(found) > 3 else None
                    if (module, name, method) not in SAFE_MSGPACK_METHODS:
                        raise refuse(self._refusal(f"{module}.{name}.{method}", writing))
                elif (module, name) not in self.allowed:
                    raise refuse(self._refusal(f"{module}.{name}", writing))
            elif code == EXT_DELTA_SNAPSHOT:
                ormsgpack.unpackb(payload, ext_hook=names, option=ormsgpack.OPT_NON_STR_KEYS)
            elif code != EXT_NUMPY_ARRAY:  # an array is data: a dtype, a shape and bytes
                raise refuse(UnsafeCheckpointError(
                    f"refused a checkpoint value: it holds an object of unknown kind {code}"))

        try:
            ormsgpack.unpackb(blob, ext_hook=names, option=ormsgpack.OPT_NON_STR_KEYS)
        except (ValueError, TypeError) as err:
            if refused:
                raise refused[0] from None
            raise UnsafeCheckpointError(f"refused a checkpoint value that is not valid "
                                        f"msgpack: {err}") from None

    @staticmethod
    def _refusal(name: str, writing: bool) -> UnsafeCheckpointError:
        if writing:
            return UnsafeCheckpointError(
                f"the graph state holds a {name}, which DexCheckpointer would not load back: "
                "declare your state's own types, DexCheckpointer(client, allowed_types=[...])")
        return UnsafeCheckpointError(
            f"refused to load a checkpoint that names {name}: it is neither one of "
            "LangGraph's safe types nor declared in DexCheckpointer(client, "
            "allowed_types=[...]); nothing in it was imported or called")
