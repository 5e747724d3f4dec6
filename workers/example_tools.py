"""The example tools under the name the tests, the docs and ``--tools workers.example_tools``
use. They live in :mod:`dex_tasks.examples.tools`, which the wheel ships; this module is the
repository's alias and is not installed."""

from dex_tasks.examples import ledger  # noqa: F401
from dex_tasks.examples.tools import *  # noqa: F403 - every tool, checker and helper
