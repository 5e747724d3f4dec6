"""The example tools' ledger under its historical name (:mod:`dex_tasks.examples.ledger`)."""

from dex_tasks.examples.ledger import ENV, append, executions, read, record

__all__ = ["ENV", "append", "executions", "read", "record"]
