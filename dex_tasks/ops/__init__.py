"""Operations: the ``dex-tasks`` command, the demo and its embedded stack.

The command starts every other process and calls into every layer, so it sits on top; the demo
and its embedded Redis are what the command runs. Nothing below imports this folder.
"""
