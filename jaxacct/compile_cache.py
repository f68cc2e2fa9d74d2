"""Where jaxacct keeps its compiled programs between processes, and how to see and clear it.

A certified PLD program takes 1-2 s to compile on a CPU core; JAX's persistent compilation
cache writes it to disk so that the next process reads it back instead. The programs of a
first answer (the front door's PLD accountant, the calibration's reads) are also exported once
(``jax.export``, into ``exports/`` in jaxacct's directory), so that a later process skips
tracing them (~0.6 s each): a warm first answer then costs little more than the imports.

Every entry point turns the cache on: the command line at start, the library at its first
compiled call (``enable``). The location is ``$JAXACCT_CACHE_DIR``, else
``~/.cache/jaxacct/xla``; where the user has set JAX's own ``jax_compilation_cache_dir`` (or
``JAX_COMPILATION_CACHE_DIR``) the compiled programs go there (that setting is left alone; the
exports stay in jaxacct's directory), and ``JAXACCT_NO_CACHE=1`` turns off all that jaxacct
writes. Note that the cache is JAX's, process-wide: once jaxacct has turned it on, the
process's other programs that take longer than its threshold to compile (0.2 s where jaxacct
sets it, ``LIBRARY_MIN_COMPILE_SECS``) are cached too.

Only ``enable`` and ``quick_options`` import JAX: ``jaxacct cache --info`` and ``--clear``
answer at once.
"""

from __future__ import annotations

import os
import shutil

_ENABLED = []  # (the directory enable() settled on, once per process: None when off)

EMITTERS_OPTION = "xla_cpu_use_fusion_emitters"
"""XLA's choice of CPU kernel emitters: its elemental emitters (False) compile a PLD program
~1 s sooner than its (default) fusion emitters (1.6-1.8 against 2.6-2.9 s at T = 100 to 3,000,
12-05), and the program runs within ~15 % of its time, either way."""


LEVEL_OPTION = "xla_backend_optimization_level"
"""The optimisation level of XLA's LLVM back end: at 0 a PLD program compiles ~2x faster (at
the command line's default setting the two programs 1.0 and 0.45 s against 0.43 and 0.24 s)
and runs 1.3-3.7x slower (the FFTs, a library's, not at all; 12-05: 28 against 81 ms at
T = 10^4, 533 against 819 ms at T = 10^5)."""


def quick_options(one_answer=False) -> dict:
  """XLA compiler options for a program that serves first answers (compiled once, run a few
  times) on CPU: the elemental emitters, and with ``one_answer`` (a process that answers one
  question: compiled, then run once or a few times) the back end's lowest level as well; none
  that ``XLA_FLAGS`` names (the user's choice, kept), and none off CPU. Asks for JAX's
  backend: call it where one is in use."""
  import jax  # pylint: disable=import-outside-toplevel

  if jax.default_backend() != "cpu":
    return {}
  flags = os.environ.get("XLA_FLAGS", "")
  options = {} if EMITTERS_OPTION in flags else {EMITTERS_OPTION: False}
  if one_answer and LEVEL_OPTION not in flags:
    options[LEVEL_OPTION] = 0
  return options


def directory() -> str:
  """The directory jaxacct's cache uses: ``$JAXACCT_CACHE_DIR``, else ``~/.cache/jaxacct/xla``."""
  chosen = os.environ.get("JAXACCT_CACHE_DIR")
  return chosen or os.path.join(os.path.expanduser("~"), ".cache", "jaxacct", "xla")


def disabled() -> bool:
  """Whether ``JAXACCT_NO_CACHE`` turns jaxacct's cache off (set to anything but "" or "0")."""
  return os.environ.get("JAXACCT_NO_CACHE", "") not in ("", "0")


LIBRARY_MIN_COMPILE_SECS = 0.2
"""The library's threshold for the cache: a program that took longer to compile is written.
JAX's default (1 s) skipped a first calibration's programs (0.4-1 s each), so a process with a
warm cache compiled them again (its first calibration, JAX imported before: 0.67-1.31 s against
0.42-0.50 s with this threshold, 12-05)."""


def _threshold_unset(jax) -> bool:
  """Whether JAX's threshold for the cache is left at its default (1 s): not named in the
  environment, and not changed in code (a value set to 1 s itself reads as the default)."""
  return ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ
          and jax.config.jax_persistent_cache_min_compile_time_secs == 1.0)


def enable(min_compile_secs=None):
  """Turns JAX's persistent compilation cache on at ``directory()`` (once per process; cheap
  after the first call) and returns the directory in use, or None where it stays off: the
  user's own JAX cache directory is kept as it is, ``JAXACCT_NO_CACHE`` turns it off, and a
  directory that cannot be created leaves the process uncached. ``min_compile_secs``: cache
  only programs that took longer to compile (``LIBRARY_MIN_COMPILE_SECS`` where None, unless
  the user has set JAX's threshold; the command line caches every program, since its process
  is its own)."""
  if _ENABLED:
    return _ENABLED[0]
  import jax  # pylint: disable=import-outside-toplevel

  users = jax.config.jax_compilation_cache_dir
  if users or disabled():
    _ENABLED.append(users or None)
    return _ENABLED[0]
  path = directory()
  if min_compile_secs is None and _threshold_unset(jax):
    min_compile_secs = LIBRARY_MIN_COMPILE_SECS
  try:
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    if min_compile_secs is not None:
      jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_secs))
  except OSError:
    path = None  # (a read-only home: run without the cache)
  _ENABLED.append(path)
  return path


def info() -> dict:
  """The cache's ``directory``, whether jaxacct would use it (``enabled``: not turned off by
  ``JAXACCT_NO_CACHE``), and the ``files`` and ``bytes`` it holds."""
  path = directory()
  files = size = 0
  for root, _, names in os.walk(path):
    for name in names:
      try:
        size += os.path.getsize(os.path.join(root, name))
        files += 1
      except OSError:
        continue  # (removed meanwhile by another process)
  return {"directory": path, "enabled": not disabled(), "files": files, "bytes": size}


def clear() -> int:
  """Removes every file of the cache directory (the directory stays); the number removed. A
  process that runs meanwhile only compiles again what it no longer finds."""
  path = directory()
  removed = info()["files"]
  if os.path.isdir(path):
    for entry in os.scandir(path):
      if entry.is_dir(follow_symlinks=False):
        shutil.rmtree(entry.path, ignore_errors=True)
      else:
        try:
          os.remove(entry.path)
        except OSError:
          removed -= 1
  return removed
