"""The module-level Celery app, for Celery's own tools: ``celery -A dex_tasks ...``.

``celery -A dex_tasks inspect ping|active|stats``, ``celery -A dex_tasks events`` and
``celery -A dex_tasks flower`` find :data:`app` here (Celery looks for ``dex_tasks.celery.app``
when the package has no ``app`` of its own). It has the configuration every dex-tasks process
uses, from the ``DEX_*`` settings (broker, JSON only, the queues), and no task bodies: it
monitors and controls workers, it does not run calls. Run workers with ``dex-tasks worker``,
which imports your tool modules and registers the task kinds.

Creating it connects to nothing: Celery apps connect on first use. Nothing in dex-tasks imports
this module, so it adds no import edge to the library.
"""

from __future__ import annotations

from dex_tasks.broker.celery_app import create_app
from dex_tasks.settings import DexSettings

app = create_app(DexSettings())

__all__ = ["app"]
