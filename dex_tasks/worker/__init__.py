"""What the worker and beat processes run: task bodies, claims, leases, retries, the sweeps.

Imports the shared core, ``store`` and ``broker``; never ``agent``, ``api`` or ``ops``.
"""
