"""Programs exported once and read back by later processes, so that they skip JAX's tracing.

The persistent compilation cache (``compile_cache``) skips XLA's compilation, not the tracing
and lowering that come before it: for a certified PLD program ~0.6 s of a warm process's first
answer. Here a program is exported (``jax.export``) the first time a process runs it on
arguments of a new structure (the pytree, with a plan's static sizes, and each leaf's shape and
dtype), and the serialised export is saved beside the compilation cache; a later process
deserialises it (~10 ms), and its compilation is then found in the compilation cache.

Only concrete top-level calls go through here (``_numerics.fast_jit(..., exported=True)``), and
only while the cache is on. The export computes what ``jax.jit(fn)`` computes (the same
lowering; no gradients are taken through it: under a caller's ``grad`` the function is traced
as usual). Anything that fails to export, save or read falls back to the plain jitted call.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import pickle

import jax
import numpy as np

from jaxacct import __version__, compile_cache

PROGRAMS = {}  # key -> (jitted call of the exported program, output tree), this process's


@functools.cache
def _serialisable():
  """Whether ``jax.export`` can serialise here (it needs the flatbuffers package)."""
  return importlib.util.find_spec("flatbuffers") is not None


def _leaf(value):
  """A leaf as an array of fixed dtype (an export's arguments have exact shapes and dtypes)."""
  return value if isinstance(value, jax.Array) else np.asarray(value)


@functools.cache
def source_digest() -> str:
  """A digest of this package's source files: a saved export is read back only by the code
  that made it (an install from a later commit keeps the version number, not the programs)."""
  root = os.path.dirname(os.path.abspath(__file__))
  digest = hashlib.sha256()
  for folder, folders, files in os.walk(root):
    folders.sort()
    for name in sorted(f for f in files if f.endswith(".py")):
      path = os.path.join(folder, name)
      digest.update(os.path.relpath(path, root).encode())
      with open(path, "rb") as file:
        digest.update(file.read())
  return digest.hexdigest()


def _key(name, in_tree, leaves):
  """The saved export's name: the function, the argument structure, shapes and dtypes, the
  platform, the versions and the source that made it."""
  text = repr((name, __version__, source_digest(), jax.__version__, jax.default_backend(),
               str(in_tree), [(np.shape(leaf), str(leaf.dtype)) for leaf in leaves]))
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def _export(fn, in_tree, leaves):
  """(the serialised export of ``fn`` on these arguments' structure, its output tree)."""
  out_tree = []

  def flat(*args):
    out = fn(*jax.tree_util.tree_unflatten(in_tree, args))
    leaves, tree = jax.tree_util.tree_flatten(out)
    out_tree.append(tree)
    return leaves

  specs = [jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype) for leaf in leaves]
  exported = jax.export.export(jax.jit(flat))(*specs)
  return exported.serialize(), out_tree[0]


def _load(path):
  """(serialised export, output tree) saved at ``path``, or None where absent or unreadable."""
  try:
    with open(path, "rb") as file:
      blob, tree = pickle.load(file)
    return bytes(blob), tree
  except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, ValueError,
          TypeError):
    return None


def _save(path, blob, tree):
  """Writes the export atomically (a concurrent process reads the old file or the new)."""
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "wb") as file:
      pickle.dump((bytes(blob), tree), file)
    os.replace(partial, path)
  except OSError:
    pass  # (a read-only cache: this process still runs its export)


def _program(fn, in_tree, leaves, path):
  """(the jitted call of the export for these arguments, its output tree): read from ``path``,
  else exported now and saved there; None where it cannot be (an unexportable operation)."""
  saved = _load(path)
  try:
    if saved is None:
      saved = _export(fn, in_tree, leaves)
      _save(path, *saved)
    return jax.jit(jax.export.deserialize(bytearray(saved[0])).call), saved[1]
  except Exception:  # pylint: disable=broad-except  (the plain jitted call serves instead)
    return None


def call(name, fn, jitted, args):
  """``fn(*args)`` on concrete ``args``: through the program exported for their structure
  (this process's, or one saved by an earlier process), or ``jitted`` where the cache is off or
  the export cannot be made or read (that once, then always ``jitted`` for it)."""
  if compile_cache.disabled() or compile_cache.enable() is None or not _serialisable():
    return jitted(*args)
  leaves, in_tree = jax.tree_util.tree_flatten(args)
  leaves = [_leaf(leaf) for leaf in leaves]
  key = _key(name, in_tree, leaves)
  if key not in PROGRAMS:
    PROGRAMS[key] = _program(fn, in_tree, leaves, os.path.join(compile_cache.directory(),
                                                               "exports", f"{key}.export"))
  if PROGRAMS[key] is None:
    return jitted(*args)
  program, out_tree = PROGRAMS[key]
  return jax.tree_util.tree_unflatten(out_tree, program(*leaves))
