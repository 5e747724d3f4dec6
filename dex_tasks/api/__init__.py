"""The HTTP API and the approval page: ``create_api(settings)`` returns the FastAPI app.

Run it with ``dex-tasks api [--host] [--port]``, or ``uvicorn --factory
dex_tasks.api:from_env``.
"""

from dex_tasks.api.app import create_api, from_env, serve

__all__ = ["create_api", "from_env", "serve"]
