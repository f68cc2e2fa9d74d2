"""Programs exported once and read back by later processes, so that they skip JAX's tracing.

The persistent compilation cache (``compile_cache``) skips XLA's compilation, not the tracing
and lowering that come before it: for a certified PLD program ~0.6 s of a warm process's first
answer. Here a program is exported (``jax.export``) the first time a process runs it on
arguments of a new structure (the pytree, with a plan's static sizes, and each leaf's shape and
dtype), and the serialised export is saved beside the compilation cache; a later process
deserialises it (~10 ms), and its compilation is then found in the compilation cache.

Only concrete top-level calls go through here (``_numerics.fast_jit(..., exported=name)``), and
only while the cache is on. The export computes what ``jax.jit(fn)`` computes (the same
lowering; no gradients are taken through it: under a caller's ``grad`` the function is traced
as usual). Anything that fails to export, save or read falls back to the plain jitted call.

An answer that needs two programs in turn (the PLD composed, then queried) can have both
compiled before it runs either (``prepare``): each is lowered in the caller's thread and
compiled on a thread of its own, so the two compile side by side (a first ``jaxacct epsilon``
at the defaults: 3.39-3.62 s against 3.81-4.24 s, 12-05). ``output_specs`` reads a program's
output shapes off its export, so the second program is prepared before the first has run.

jax.export's lowering of an exported call sets up jaxlib's CPU LAPACK kernels whatever the
module holds, and jaxlib reads them from scipy.linalg: an import of ~0.2-0.3 s, a fifth of a warm
first answer. A module read here that names no LAPACK target (its serialised bytes hold no
"lapack") is lowered without that setup (``_lapack_setup_skipped``); any other, and any where
jax's setup does more than LAPACK's (another jax), is lowered as jax has it.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import contextvars
import functools
import hashlib
import importlib.util
import os
import pickle
import threading
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxacct import __version__, compile_cache


class _Program(NamedTuple):
  """A program read or exported in this process: its jitted call, its output tree, its
  outputs' shapes and dtypes (flat), its executable where ``prepare`` compiled it ahead (for
  the default device of that moment), and whether its module calls no LAPACK routine."""
  call: Any
  out_tree: Any
  out_specs: list
  compiled: Any = None
  lapack_free: bool = False


# Set while a module that calls no LAPACK routine is lowered (``_lapack_setup_skipped``).
_LAPACK_FREE = contextvars.ContextVar("jaxacct_lapack_free", default=False)


# What jax.export's backend setup may name for the wrapper to be installed: LAPACK's alone.
_LAPACK_SETUP_NAMES = {"linalg", "initialize_lapack"}


@functools.cache
def _guard_lapack_setup() -> bool:
  """Wraps jax.export's setup of the CPU LAPACK kernels so that it is skipped while
  ``_LAPACK_FREE`` is set (in this thread); False where jax's internals are not as expected
  (the function absent, or naming anything beyond LAPACK's setup): then nothing is skipped."""
  try:
    from jax._src.export import _export as jax_export  # pylint: disable=import-outside-toplevel
    setup = jax_export._ensure_backends_initialized  # pylint: disable=protected-access
    if not set(setup.__code__.co_names) <= _LAPACK_SETUP_NAMES:
      return False
  except (ImportError, AttributeError):
    return False

  def ensure_backends_initialized(*args, **kwargs):
    if not _LAPACK_FREE.get():
      setup(*args, **kwargs)

  jax_export._ensure_backends_initialized = ensure_backends_initialized
  return True


@contextlib.contextmanager
def _lapack_setup_skipped(program):
  """Within this context, a lowering of ``program``'s call skips the LAPACK setup where its
  module calls no LAPACK routine."""
  token = _LAPACK_FREE.set(program.lapack_free and _guard_lapack_setup())
  try:
    yield
  finally:
    _LAPACK_FREE.reset(token)


# (key, default device, compiler options) -> _Program, None (plain jit serves), or a Future of a
# _Program while ``prepare`` compiles it
PROGRAMS = {}


@functools.cache
def _serialisable():
  """Whether ``jax.export`` can serialise here (it needs the flatbuffers package)."""
  return importlib.util.find_spec("flatbuffers") is not None


def _leaf(value):
  """A leaf as an array of fixed dtype (an export's arguments have exact shapes and dtypes),
  or the ``jax.ShapeDtypeStruct`` it is."""
  return value if isinstance(value, (jax.Array, jax.ShapeDtypeStruct)) else np.asarray(value)


def _spec(value):
  """A leaf's shape and dtype (``jax.ShapeDtypeStruct``), from a value or a spec already."""
  value = _leaf(value)
  if isinstance(value, jax.ShapeDtypeStruct):
    return value
  return jax.ShapeDtypeStruct(value.shape, value.dtype)


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
  return _signature_key(name, source_digest(), in_tree,
                        tuple((tuple(leaf.shape), leaf.dtype) for leaf in leaves))


@functools.lru_cache(maxsize=1024)
def _signature_key(name, source, in_tree, signature):
  """``_key`` of a hashable signature of (shape, dtype) pairs (a digest is ~50 us, and a
  dtype's name ~6 us: a warm call asks for them again)."""
  text = repr((name, __version__, source, jax.__version__, jax.default_backend(),
               str(in_tree), [(shape, str(dtype)) for shape, dtype in signature]))
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def _here(key, options=None):
  """The in-process table's key of a program: its export's key, the default device (a program
  compiled ahead by ``prepare`` runs on the device it was lowered for) and the XLA options it
  is compiled with (one export serves programs compiled with different options)."""
  return key, str(jax.config.jax_default_device), tuple(sorted((options or {}).items()))


def _signature(name, args, options=None):
  """(the export's key, the in-process key, the argument tree, its leaves as ``_leaf``s) of a
  call of ``name`` on ``args`` compiled with ``options``."""
  leaves, in_tree = jax.tree_util.tree_flatten(args)
  leaves = [_leaf(leaf) for leaf in leaves]
  key = _key(name, in_tree, leaves)
  return key, _here(key, options), in_tree, leaves


def _export(fn, in_tree, leaves):
  """(the serialised export of ``fn`` on these arguments' structure, its output tree)."""
  out_tree = []

  def flat(*args):
    out = fn(*jax.tree_util.tree_unflatten(in_tree, args))
    leaves, tree = jax.tree_util.tree_flatten(out)
    out_tree.append(tree)
    return leaves

  specs = [_spec(leaf) for leaf in leaves]
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


def _program(fn, in_tree, leaves, path, options=None):
  """The ``_Program`` of the export for these arguments (compiled with the XLA ``options``
  where given): read from ``path``, else exported now and saved there; None where it cannot be
  (an unexportable operation)."""
  saved = _load(path)
  try:
    if saved is None:
      saved = _export(fn, in_tree, leaves)
      _save(path, *saved)
    exported = jax.export.deserialize(bytearray(saved[0]))
    return _Program(jax.jit(exported.call, compiler_options=options), saved[1],
                    [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exported.out_avals],
                    lapack_free=b"lapack" not in saved[0])
  except Exception:  # pylint: disable=broad-except  (the plain jitted call serves instead)
    return None


def active() -> bool:
  """Whether concrete calls go through exported programs (the cache is on, exports serialise)."""
  return not compile_cache.disabled() and compile_cache.enable() is not None and _serialisable()


def _entry(name, fn, args, options):
  """(its key here, flat leaves, the ``_Program`` or None) for these concrete arguments, made
  (exported or read) where this process has none yet for the default device; a program
  ``prepare`` is still compiling is waited for."""
  key, here, in_tree, leaves = _signature(name, args, options)
  program = PROGRAMS.get(here, False)
  if program is False:
    program = _program(fn, in_tree, leaves, _path(key), options)
  elif isinstance(program, concurrent.futures.Future):
    program = program.result()
  PROGRAMS[here] = program
  return here, leaves, program


def _path(key):
  return os.path.join(compile_cache.directory(), "exports", f"{key}.export")


def call(name, fn, jitted, args, options=None):
  """``fn(*args)`` on concrete ``args``: through the program exported for their structure
  (this process's, or one saved by an earlier process; its executable where ``prepare``
  compiled it, waited for while it compiles), or ``jitted`` where the cache is off or the
  export cannot be made or read (that once, then always ``jitted`` for it)."""
  if not active():
    return jitted(*args)
  here, leaves, program = _entry(name, fn, args, options)
  if program is None:
    return jitted(*args)
  if program.compiled is not None:
    try:
      return jax.tree_util.tree_unflatten(program.out_tree, program.compiled(*leaves))
    except (TypeError, ValueError):  # (arguments of other types or placement than prepared:
      PROGRAMS[here] = program = program._replace(compiled=None)  # the jitted call from now)
  with _lapack_setup_skipped(program):
    outputs = program.call(*leaves)
  return jax.tree_util.tree_unflatten(program.out_tree, outputs)


def output_specs(name, fn, args, options=None):
  """The shapes and dtypes of ``fn(*args)`` (a tree of ``jax.ShapeDtypeStruct``) from the
  program's export (made or read now; not compiled here, though one ``prepare`` is compiling
  is waited for); None where calls do not go through exports."""
  if not active():
    return None
  program = _entry(name, fn, args, options)[2]
  return None if program is None else jax.tree_util.tree_unflatten(program.out_tree,
                                                                    program.out_specs)


def _compiled_here(program) -> bool:
  """Whether a ``PROGRAMS`` entry is a program this process has compiled (ahead, or by a call)."""
  return isinstance(program, _Program) and (program.compiled is not None
                                            or program.call._cache_size() > 0)


# The compilations ``prepare`` has started that have not ended: the process waits for them at
# exit, before JAX's own clean-up (a compilation still running on a thread of its own while the
# runtime is torn down would not end cleanly).
_COMPILING = set()


@atexit.register
def _wait_for_compilations():
  for future in list(_COMPILING):
    future.result()


def _forget_compilations():
  """In a forked child: the compilations its parent's threads ran (not running here) are
  dropped, so that nothing waits for them (``call`` makes such a program anew)."""
  for here, program in list(PROGRAMS.items()):
    if isinstance(program, concurrent.futures.Future) and not program.done():
      del PROGRAMS[here]
  _COMPILING.clear()


if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=_forget_compilations)


def _thread_name(name, options):
  """The compiling thread's name: the program's, marked where it is compiled at the back end's
  lowest level."""
  level = (options or {}).get(compile_cache.LEVEL_OPTION)
  return f"jaxacct-compile-{name}" + ("" if level is None else f".level{level}")


def prepare(name, fn, args, options=None):
  """Compiles ``fn``'s program for arguments like ``args`` (values or ``jax.ShapeDtypeStruct``)
  on a thread of its own: exported (or read) and lowered here, then compiled there while the
  caller goes on (XLA's compiler releases Python's lock), so that programs prepared one after
  the other compile side by side. (Only the compilation leaves the caller's thread: JAX's
  tracing and lowering are not safe beside another thread's.) A later ``call`` on such
  arguments (on the same default device) waits for it, and the process waits for it at exit.
  Nothing where this process has the program compiled already, or compiling, or where calls do
  not go through exports."""
  if not active():
    return
  key, here, in_tree, leaves = _signature(name, args, options)
  known = PROGRAMS.get(here, False)
  if known is None or isinstance(known, concurrent.futures.Future) or _compiled_here(known):
    return  # (plain jit serves it, it is compiling, or it is compiled)
  specs = [_spec(leaf) for leaf in leaves]
  try:
    with jax.enable_x64(True):
      program = known or _program(fn, in_tree, leaves, _path(key), options)
      lowered = None
      if program is not None:
        with _lapack_setup_skipped(program):
          lowered = program.call.lower(*specs)
  except Exception:  # pylint: disable=broad-except  (``call`` makes it, or plain jit serves)
    return
  if lowered is None:
    PROGRAMS[here] = program
    return
  future = concurrent.futures.Future()

  def compile_lowered():
    made = program  # (its jitted call serves where the compilation fails)
    try:
      made = program._replace(compiled=lowered.compile())
    except Exception:  # pylint: disable=broad-except
      pass
    finally:  # (whatever happens, the waiting call goes on)
      future.set_result(made)
      _COMPILING.discard(future)

  _COMPILING.add(future)
  PROGRAMS[here] = future
  try:
    threading.Thread(target=compile_lowered, name=_thread_name(name, options),
                     daemon=True).start()
  except RuntimeError:  # (no thread to be had: ``call`` compiles it, with the program's jit)
    future.set_result(program)
    _COMPILING.discard(future)
