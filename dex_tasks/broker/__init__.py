"""Redis and Celery messages: what every process that sends or receives a call shares.

The Celery app's configuration and publishing, queue names and routing, Redis connections, the
notifications that wake waiters and the counters kept in Redis. Agent processes, workers, beat
and the API all send or read these, so they sit below ``agent`` and ``worker`` and above
``store`` (a message names a stored call). Imports the shared core and ``store`` only.
"""
