"""Field docstrings of :class:`MemSafePlugin`, read from its source (for ``--help`` and the docs test)."""

from __future__ import annotations

import ast
import functools
import inspect


@functools.lru_cache(maxsize=1)
def option_docs() -> dict[str, str]:
    """Option name -> the docstring written under its field in ``MemSafePlugin``.

    Example:
        >>> "bucket_bytes" in option_docs()
        True
    """
    from .plugin import MemSafePlugin

    tree = ast.parse(inspect.getsource(MemSafePlugin))
    body = tree.body[0].body
    out: dict[str, str] = {}
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and i + 1 < len(body):
            nxt = body[i + 1]
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                out[node.target.id] = " ".join(nxt.value.value.split())
    return out
