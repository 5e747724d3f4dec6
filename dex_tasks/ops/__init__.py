"""Operations: the ``dex-tasks`` command, the demo and its embedded stack.

The command starts every other process and calls into every layer, so it sits on top; the demo
and its embedded Redis are what the command runs. Nothing below imports this folder. The
command's groups are a module each (``cli_processes``, ``cli_inspect``, ``cli_approvals``,
``cli_store``); a server an integration provides (``dex-tasks mcp``) is found through the
``dex_tasks.servers`` entry point, so this folder never imports an integration.
"""
