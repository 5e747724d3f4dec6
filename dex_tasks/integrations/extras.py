"""The one way an integration says that its framework is not installed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def needs_extra(extra: str, module: str) -> Iterator[None]:
    """Imports of ``module``'s framework: a missing one is an :class:`ImportError` that names
    the extra to install (``pip install "dex-tasks[extra]"``), with the original as its cause.
    """
    try:
        yield
    except ImportError as err:
        raise ImportError(
            f'{module} needs the {extra} extra: pip install "dex-tasks[{extra}]"') from err
