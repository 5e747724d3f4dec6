"""What an agent process runs: the clients, new calls, approvals and reconciliation.

Imports the shared core, ``store`` and ``broker``; never ``worker`` (an agent process runs no
tool code), ``api`` or ``ops``.
"""
