"""Build the first release's tables the way that release did: ``create_all`` of its models.

``models_c28862d.py`` is that release's ``dex_tasks/store/models.py`` (commit c28862d), unchanged.
Run as a script, in a process of its own, so its tables never meet today's in one metadata:

    python tests/legacy/create_c28862d.py DATABASE_URL
"""

from __future__ import annotations

import sys

import models_c28862d  # noqa: F401 - registers the first release's tables
from sqlmodel import SQLModel, create_engine

engine = create_engine(sys.argv[1])
SQLModel.metadata.create_all(engine)
engine.dispose()
