"""Which modules a model's code uses without calling them, read from the source of its ``forward``.

FSDP2 unshards a group in a forward pre-hook of the group's module and reshards it after that module's forward. A
module that the code uses otherwise cannot be a group of its own, or the code meets a sharded ``DTensor`` (or, after
the reshard, a parameter without storage):

- a parent reads a child's parameter, ``F.embedding(ids, self.ngram_embeddings.weight)`` (ProphetNet's decoder);
- a parent calls a child's method other than through the child's ``__call__``, ``self.experts.map(x)`` (JetMoE's
  attention experts, whose ``forward`` raises);
- a module's ``forward`` returns one of its own parameters, ``return out, self.dense_bias`` (GPT-NeoX-Japanese's
  attention): its caller uses it after the reshard.

transformers declares the first kind for some models (``force_accelerate_hooks``, read by
:func:`~accelerate_memsafe._compat.directly_used_children`); this module finds the three kinds in any model's source: the
``forward`` of each module class and the methods of the class it calls as ``self.name(...)``, parsed once per class.
What it cannot read (no source, a chain through an index ``self.layers[0].weight``, a ``getattr``) it does not find,
and such a module is grouped as the wrap policy picks it, as without the plugin. A module found here that did not need
it only joins its parent's group (coarser sharding, never a wrong result).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass

import torch

#: Attributes of a tensor that read its metadata, not its values: a sharded ``DTensor`` answers them as the whole tensor
#: would (``self.embed.weight.dtype`` is no use of the weight).
TENSOR_METADATA = frozenset({
    "device", "dim", "dtype", "element_size", "is_cuda", "is_floating_point", "is_meta", "layout", "ndim", "nelement",
    "numel", "requires_grad", "shape", "size",
})

#: Built-ins whose first argument's type is all they read.
_TYPE_CHECKS = frozenset({"isinstance", "type", "id", "callable"})

#: How many methods of one class are read, ``forward`` and those it calls (transitively): a bound on the work.
MAX_METHODS = 32


@dataclass(frozen=True)
class CodeUses:
    """What the code of one module class does with ``self``'s attributes (:func:`code_uses`)."""

    chains: tuple[tuple[str, ...], ...] = ()
    """Attribute chains ``self.a.b...`` of two names or more that the code reads (``("experts", "map")``)."""
    returned: frozenset[str] = frozenset()
    """Names ``x`` of the ``self.x`` that ``forward`` returns as they are (alone or as an element of a tuple)."""


_NONE = CodeUses()


def _function_tree(fn) -> tuple[ast.AST, str] | None:
    """The syntax tree of ``fn``'s source and the name of its first argument (``self``), or ``None``."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))
        tree = ast.parse(source)
    except Exception:  # no source, a cycle of wrappers, code the parser refuses: nothing read, as without the plugin
        return None
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.args.args:
        return None
    return node, node.args.args[0].arg


def _read_in_torch(fn) -> bool:
    """Whether ``fn`` is torch's own code (``nn.Module``'s methods): never read."""
    try:
        fn = inspect.unwrap(fn)
    except ValueError:  # a cycle of `__wrapped__`
        pass
    return (getattr(fn, "__module__", None) or "").startswith("torch.")


@functools.cache
def code_uses(module_type: type, entry: str = "forward") -> CodeUses:
    """The attribute chains of ``self`` that ``module_type``'s method ``entry`` and the methods it calls as
    ``self.name(...)`` read, and what ``forward`` returns of ``self``'s attributes; cached per class and entry. A class
    without readable source (built in, written at run time) gives nothing.

    Example:
        >>> class Mixer(torch.nn.Module):
        ...     def forward(self, x):
        ...         return self.helper(x), self.bias
        ...     def helper(self, x):
        ...         return x @ self.proj.weight.T + self.proj.weight.dtype.itemsize
        >>> uses = code_uses(Mixer)
        >>> sorted(uses.chains), sorted(uses.returned)
        ([('proj', 'weight', 'T'), ('proj', 'weight', 'dtype', 'itemsize')], ['bias'])
    """
    first = getattr(module_type, entry, None)
    if first is None or _read_in_torch(first):
        return _NONE
    chains: set[tuple[str, ...]] = set()
    returned: set[str] = set()
    queue, seen = [entry], {entry}
    while queue and len(seen) <= MAX_METHODS:
        name = queue.pop()
        fn = inspect.getattr_static(module_type, name, None)
        fn = getattr(fn, "__func__", fn)  # a staticmethod / classmethod object
        if not callable(fn) or _read_in_torch(fn):
            continue
        parsed = _function_tree(fn)
        if parsed is None:
            continue
        tree, me = parsed
        stack: list[ast.AST] = [tree]
        while stack:  # one pass; an attribute chain is read whole, from its outermost node
            node = stack.pop()
            if isinstance(node, ast.Attribute):
                names: list[str] = []
                cur: ast.AST = node
                while isinstance(cur, ast.Attribute):
                    names.append(cur.attr)
                    cur = cur.value
                if isinstance(cur, ast.Name) and cur.id == me and len(names) >= 2:
                    chains.add(tuple(reversed(names)))
                stack.append(cur)  # what the chain starts from (a call, a subscript) is read too
                continue
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _TYPE_CHECKS:
                stack.extend(node.args[1:])  # `isinstance(self.wo.weight, torch.Tensor)` reads no value
                continue
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == me):
                called = node.func.attr  # `self.helper(...)`: a method of the class, read too
                if called not in seen and inspect.isfunction(inspect.getattr_static(module_type, called, None)):
                    seen.add(called)
                    queue.append(called)
            elif name == "forward" and isinstance(node, ast.Return) and node.value is not None:
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                returned.update(v.attr for v in values if isinstance(v, ast.Attribute)
                                and isinstance(v.value, ast.Name) and v.value.id == me)
            stack.extend(ast.iter_child_nodes(node))
    return CodeUses(tuple(sorted(chains)), frozenset(returned))


def _is_method(module: torch.nn.Module, name: str) -> bool:
    """Whether ``module.name`` is a method of its own class that is no part of ``nn.Module``'s machinery (``forward``
    included: ``self.child.forward(x)`` skips the child's hooks), so a call of it runs the child's code without its
    hooks."""
    if name == "forward":
        return True
    if hasattr(torch.nn.Module, name):
        return False
    return callable(inspect.getattr_static(type(module), name, None))


def modules_used_directly(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``module``'s subtree that ``module``'s code (:func:`code_uses`) uses without calling them, and
    ``module`` itself when its ``forward`` returns one of its own parameters. For a chain ``self.a.b.weight`` both
    ``a`` and ``b``: a group of either would be resharded when ``module``'s code reads the weight.

    Example:
        >>> class Decoder(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.ngram = torch.nn.Embedding(2, 4)
        ...         self.proj = torch.nn.Linear(4, 4)
        ...     def forward(self, x):
        ...         return self.proj(x + self.ngram.weight[0]).to(self.proj.weight.dtype)
        >>> d = Decoder()
        >>> modules_used_directly(d) == [d.ngram]
        True
    """
    uses = code_uses(type(module))
    out: dict[int, torch.nn.Module] = {}
    _resolve(module, uses, out, {(id(module), "forward")})
    if any(module._parameters.get(name) is not None for name in uses.returned):
        out[id(module)] = module
    return list(out.values())


def _resolve(module: torch.nn.Module, uses: CodeUses, out: dict[int, torch.nn.Module], done: set) -> None:
    """Adds to ``out`` the modules of ``module``'s subtree that ``uses`` (its code's chains) reach without calling them;
    a child's method called that way runs without the child's hooks, so what that method's code uses is added too."""
    for chain in uses.chains:
        path: list[torch.nn.Module] = []
        cur = module
        for i, name in enumerate(chain):
            child = cur._modules.get(name)
            if child is not None:
                path.append(child)
                cur = child
                continue
            if path and name in cur._parameters and (i + 1 == len(chain) or chain[i + 1] not in TENSOR_METADATA):
                out.update((id(m), m) for m in path)
            elif path and _is_method(cur, name):
                out.update((id(m), m) for m in path)
                if (id(cur), name) not in done and len(done) < MAX_METHODS:
                    done.add((id(cur), name))
                    _resolve(cur, code_uses(type(cur), name), out, done)
            break
