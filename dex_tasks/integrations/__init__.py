"""Adapters that give agent frameworks' tools dex-tasks semantics in a few lines.

One module per framework, each importing its framework only there and installed as an extra:

* ``dex_tasks.integrations.langchain`` (``pip install "dex-tasks[langchain]"``)
* ``dex_tasks.integrations.pydantic_ai`` (``[pydantic-ai]``)
* ``dex_tasks.integrations.openai_agents`` (``[openai-agents]``)
* ``dex_tasks.integrations.mcp`` (``[mcp]``): an MCP server's tools as dex tools
* ``dex_tasks.integrations.mcp_server`` (``[mcp]``): ``dex-tasks mcp``, the catalog as an MCP
  server
* ``dex_tasks.integrations.google_adk`` (``[google-adk]``)
* ``dex_tasks.integrations.crewai`` (``[crewai]``)

The core never imports these modules; they use only the public names of ``dex_tasks``.
"""
