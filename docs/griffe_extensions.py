"""Griffe extensions: what jaxacct sets up at import time, read statically for the API reference.

Loaded by mkdocstrings (``mkdocs.yml``) and by ``docs/hooks.py``'s check of the public names.
Nothing is imported: each reads the module's syntax tree, so building the site imports no JAX.

* ``LazyExports``: the names a package imports on first use (PEP 562). ``jaxacct/__init__.py``
  maps each public name to the module that defines it in a dict ``_EXPORTS`` (``jaxacct.interop``:
  ``_HOMES``) and imports it in ``__getattr__``, so a static reader sees no import behind
  ``jaxacct.dpsgd_epsilon``. The dict's expression is evaluated with no builtins but ``dict``
  (our own literal, not executed code) and every name is added as an alias of the object it
  names: ``::: jaxacct.dpsgd_epsilon`` resolves, and the reference documents the name as
  ``jaxacct.dpsgd_epsilon``. An ``__all__`` computed from the dict (``sorted(_HOMES)``) is
  computed the same way. A package with ordinary imports is left as it is.
* ``SharedDocstrings``: a docstring completed at import time by a loop such as
  ``for _fn in (a, b): _fn.__doc__ += _SHARED`` (``jaxacct.calibrate``'s front doors share
  their arguments' text) gets the same text in the reference.
* ``HideSpecialMembers``: a class's ``__post_init__``, ``__str__``, ... are left out of its
  members.
"""

from __future__ import annotations

import ast
import inspect

import griffe

# The names of a package's {public name: defining module} table.
EXPORT_TABLES = ("_EXPORTS", "_HOMES")
# What the table's expression, and an ``__all__`` computed from it, may call.
_BUILTINS = {"dict": dict, "list": list, "sorted": sorted, "tuple": tuple}


def _assignments(node: ast.Module):
  """(name, value expression) of each module-level assignment to one name."""
  for statement in node.body:
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
      target, value = statement.targets[0], statement.value
    elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
      target, value = statement.target, statement.value
    else:
      continue
    if isinstance(target, ast.Name):
      yield target.id, value


def _evaluate(value: ast.expr, package: str, names: dict) -> object:
  """An expression of our own source, evaluated with only ``_BUILTINS`` and ``names``."""
  expression = compile(ast.Expression(value), f"{package}/__init__.py", "eval")
  return eval(expression, {"__builtins__": _BUILTINS, "__name__": package, **names})  # noqa: S307


def lazy_exports(node: ast.Module, package: str) -> tuple[str | None, dict[str, str]]:
  """(the table's name, ``{name: module}``) of a package ``__init__``'s export table (its AST
  ``node``), or ``(None, {})`` where there is none."""
  for name, value in _assignments(node):
    if name in EXPORT_TABLES:
      exports = _evaluate(value, package, {})
      if not isinstance(exports, dict):
        raise TypeError(f"{package}.{name} is not a dict")
      return name, exports
  return None, {}


class LazyExports(griffe.Extension):
  """Adds each name of a package's ``_EXPORTS`` as an alias of ``module.name`` (a submodule,
  which griffe loads by itself, is skipped)."""

  def on_module_members(self, *, node, mod, agent, **kwargs):  # noqa: ARG002 - griffe's hook
    if not isinstance(node, ast.Module) or not mod.is_init_module:
      return
    table, exports = lazy_exports(node, mod.path)
    for name, module in exports.items():
      if module == f"{mod.path}.{name}" or name in mod.members:
        continue
      mod.set_member(name, griffe.Alias(name, f"{module}.{name}", parent=mod))
    if table is not None and not mod.exports:  # griffe reads sorted(_HOMES) as no names
      for name, value in _assignments(node):
        if name == "__all__":
          mod.exports = [str(n) for n in _evaluate(value, mod.path, {table: exports})]


def _string_constants(node: ast.Module) -> dict[str, str]:
  """The module-level ``NAME = "..."`` assignments of a module."""
  out = {}
  for statement in node.body:
    if (isinstance(statement, ast.Assign) and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Name)
        and isinstance(statement.value, ast.Constant) and isinstance(statement.value.value, str)):
      out[statement.targets[0].id] = statement.value.value
  return out


class SharedDocstrings(griffe.Extension):
  """Appends ``SHARED`` to each function's docstring where the module runs
  ``for var in (f, g, ...): var.__doc__ += SHARED`` (``SHARED`` a module-level string)."""

  def on_module_members(self, *, node, mod, agent, **kwargs):  # noqa: ARG002 - griffe's hook
    if not isinstance(node, ast.Module):
      return
    constants = _string_constants(node)
    for statement in node.body:
      if not (isinstance(statement, ast.For) and isinstance(statement.target, ast.Name)
              and isinstance(statement.iter, (ast.Tuple, ast.List))):
        continue
      for line in statement.body:
        if (isinstance(line, ast.AugAssign) and isinstance(line.op, ast.Add)
            and isinstance(line.target, ast.Attribute) and line.target.attr == "__doc__"
            and isinstance(line.target.value, ast.Name)
            and line.target.value.id == statement.target.id
            and isinstance(line.value, ast.Name) and line.value.id in constants):
          for function in statement.iter.elts:
            if isinstance(function, ast.Name):
              _append(node, mod, function.id, constants[line.value.id])


def _append(node: ast.Module, module: griffe.Module, name: str, text: str) -> None:
  """``module.name``'s docstring with ``text`` appended as Python appends it (then cleaned)."""
  obj = module.members.get(name)
  if obj is None or obj.is_alias or obj.docstring is None:
    return
  old = obj.docstring
  raw = next((ast.get_docstring(statement, clean=False) for statement in node.body
              if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef))
              and statement.name == name), None) or old.value
  obj.docstring = griffe.Docstring(inspect.cleandoc(raw + text), lineno=old.lineno,
                                   endlineno=old.endlineno, parent=obj, parser=old.parser,
                                   parser_options=old.parser_options)



class HideSpecialMembers(griffe.Extension):
  """Leaves a class's special members (``__post_init__``, ``__str__``, ...) out of the
  reference, so it lists what users call; the constructor's signature is shown on the class
  itself (``merge_init_into_class``), so ``__init__`` stays. (Removed rather than marked
  private: a class documented through an alias, ``jaxacct.pld.Plan``, reads its members'
  publicity from the alias.)"""

  def on_class_members(self, *, node, cls, agent, **kwargs):  # noqa: ARG002 - griffe's hook
    for name in [name for name in cls.members if name.startswith("__") and name.endswith("__")
                 and name != "__init__"]:
      cls.del_member(name)
