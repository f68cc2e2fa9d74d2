"""Numerical building blocks shared by every accountant.

* ``float64``: a decorator that runs a public function under a scoped ``jax.enable_x64`` so that
  accounting is float64 without touching the process-wide flag.
* ``accounting_device``: the scope host-side accounting runs in (the CPU backend by default);
  ``host_values``: arrays fetched whole to the host, across processes too.
* small stable special functions used by the models and the PLD accountant.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import threading

import jax
import jax.numpy as jnp
import jax.scipy.special
import numpy as np

from jaxacct import _exported, compile_cache

F64_EPS = float(np.finfo(np.float64).eps)
# Loss values beyond +-LOSS_BIG carry no mass for any supported model; clamping edges there keeps
# every intermediate finite (and every gradient free of inf * 0).
LOSS_BIG = 1.0e4
# The smallest normal float64 and its log: an upper bound exp'd below it would read 0.0.
TINY = float(np.finfo(np.float64).tiny)
LOG_TINY = float(np.log(TINY))


def exp_upper(log_value):
  """exp of the log of an upper bound, never below the smallest normal float64: exp would
  return 0.0 there, which is below any positive true value (and so not an upper bound)."""
  return jnp.where(log_value < LOG_TINY, TINY, jnp.exp(jnp.maximum(log_value, LOG_TINY)))


def floored_status(log_value, bit):
  """``bit`` (results.UPPER_FLOORED) where ``exp_upper`` floors ``log_value``, else 0."""
  return jnp.where(log_value < LOG_TINY, bit, 0).astype(jnp.int32)


_HOST_TYPES = (np.ndarray, np.generic, float, int, bool)


def as_leaf(value):
  """A list or tuple of host numbers as one float64 array (a batch), not a pytree of scalars."""
  host = isinstance(value, (list, tuple)) and all(
      isinstance(v, _HOST_TYPES) for v in jax.tree_util.tree_leaves(value))
  return np.asarray(value, np.float64) if host else value


def array_namespace(*values):
  """numpy when every value is a host value (numpy array or Python number), else jax.numpy.

  The models' ``cdf_sf`` and ``loss_range`` are written against either, so the planner can
  evaluate them on the host (no compilation) and the accountants in JAX (traced, batched).
  """
  leaves = jax.tree_util.tree_leaves(values)
  return np if all(isinstance(v, _HOST_TYPES) for v in leaves) else jnp


_SCIPY_ERFC_SIZE = 100_000  # host arrays at least this long: scipy's erfc, ~5x faster a value


def erfc(x):
  """The complementary error function, on the host or in JAX. On the host, libm's element by
  element (within 3e-16 relative) for arrays under ``_SCIPY_ERFC_SIZE`` values, so that a first
  answer does not import scipy (~0.13 s); scipy's (within 6e-14) for larger ones."""
  if isinstance(x, _HOST_TYPES):
    if np.size(x) < _SCIPY_ERFC_SIZE:
      flat = np.ravel(np.asarray(x, np.float64)).tolist()
      return np.fromiter(map(math.erfc, flat), np.float64, len(flat)).reshape(np.shape(x))
    import scipy.special  # pylint: disable=import-outside-toplevel
    return scipy.special.erfc(x)
  return jax.scipy.special.erfc(x)


# Below this, log Phi(x) from its asymptotic series (erfc would be near its underflow).
_LOG_NDTR_SERIES_BELOW = -30.0
# (2k - 1)!! for k = 1...8: log Phi(x) = -x^2/2 - log(-x sqrt(2 pi)) + log(1 + sum_k
# (-1)^k (2k - 1)!! / x^(2k)); at x <= -30 the first dropped term is below 2e-18 relative.
_DOUBLE_FACTORIALS = np.cumprod(np.arange(1.0, 16.0, 2.0))


def host_log_ndtr(x):
  """log Phi(x), the standard normal's log CDF, on the host (numpy and ``erfc``: for arrays of
  under ``_SCIPY_ERFC_SIZE`` values no scipy import, ~0.2 s of a first calibration):
  log1p(-Phi(-x)) above 0, log(erfc(-x/sqrt 2)/2) down to ``_LOG_NDTR_SERIES_BELOW``, the
  asymptotic series below (to ~1e-15 relative)."""
  x = np.asarray(x, np.float64)
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    # Phi(-|x|), from one erfc (|x| held at the series' edge below 0, where it is not read)
    tail = 0.5 * erfc(np.where(x > 0.0, x, -np.maximum(x, _LOG_NDTR_SERIES_BELOW))
                      / math.sqrt(2.0))
    upper, middle = np.log1p(-tail), np.log(tail)
    far = np.minimum(x, _LOG_NDTR_SERIES_BELOW)
    inverse = 1.0 / (far * far)
    powers = inverse[..., None] ** np.arange(1, len(_DOUBLE_FACTORIALS) + 1)
    signs = (-1.0) ** np.arange(1, len(_DOUBLE_FACTORIALS) + 1)
    series = np.log1p(np.sum(signs * _DOUBLE_FACTORIALS * powers, axis=-1))
    tail = -0.5 * far * far - np.log(-far) - 0.5 * math.log(2.0 * math.pi) + series
  return np.where(x > 0.0, upper, np.where(x >= _LOG_NDTR_SERIES_BELOW, middle, tail))


def host_logsumexp(x, axis=-1):
  """log sum exp(x) along ``axis`` on the host (numpy; -inf where every term is -inf)."""
  x = np.asarray(x, np.float64)
  peak = np.max(x, axis=axis, keepdims=True)
  peak = np.where(np.isfinite(peak), peak, 0.0)
  with np.errstate(divide="ignore"):
    return np.log(np.sum(np.exp(x - peak), axis=axis)) + np.squeeze(peak, axis)


def sigmoid(x):
  """1 / (1 + e^{-x}), on the host (numpy, the stable form for either sign) or in JAX."""
  if isinstance(x, _HOST_TYPES):
    e = np.exp(-np.abs(x))
    return np.where(np.asarray(x) >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))
  return jax.nn.sigmoid(x)


# Taylor coefficients of sin r / r and cos r in r^2 (to r^16 and r^18): on |r| <= pi/4 the first
# dropped terms are below 1e-19 relative.
_SIN_TAYLOR = np.array([(-1.0) ** i / math.factorial(2 * i + 1) for i in range(9)])
_COS_TAYLOR = np.array([(-1.0) ** i / math.factorial(2 * i) for i in range(10)])


def _horner(coefficients, x):
  out = jnp.full_like(x, coefficients[-1])
  for c in coefficients[-2::-1]:
    out = out * x + c
  return out


def sin_cos_pi_fraction(j, n):
  """(sin(pi j / n), cos(pi j / n)) for integer-valued float64 ``j`` (|j| < 2^52) and integer n,
  each within a few ulps of its own size (near a zero too). The angle is reduced exactly, in
  whole multiples of n/2 (a quarter turn), then a polynomial of |r| <= pi/4 runs: elementwise
  arithmetic that XLA:CPU vectorises, ~6x faster than two of its f64 ``sin`` (libm calls),
  whose reduction of a rounded angle also errs by ~|angle| eps absolute."""
  half = 0.5 * n
  quarter = jnp.round(j / half)            # the multiple of pi/2 nearest the angle
  rest = j - quarter * half                # exact: |rest| <= n/4 (+ round-off of the quotient)
  r = rest * (math.pi / n)
  r2 = r * r
  sin_r, cos_r = r * _horner(_SIN_TAYLOR, r2), _horner(_COS_TAYLOR, r2)
  turn = jnp.remainder(quarter, 4.0)       # pi j/n = r + turn pi/2 (mod 2 pi)
  sin = jnp.where(turn == 0.0, sin_r, jnp.where(turn == 1.0, cos_r,
                                                jnp.where(turn == 2.0, -sin_r, -cos_r)))
  cos = jnp.where(turn == 0.0, cos_r, jnp.where(turn == 1.0, -sin_r,
                                                jnp.where(turn == 2.0, -cos_r, sin_r)))
  return sin, cos


def float64(fn):
  """Runs ``fn`` with float64 enabled for its own computation only (scoped, not process-wide)."""

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    with jax.enable_x64(True):
      return fn(*args, **kwargs)

  return wrapper


def accounting_device(device=None):
  """A scope whose default device is ``device`` (default: the first CPU device).

  Host-side accounting (budgets, reports, calibration) is float64 with complex128 FFTs: on a
  TPU there is no complex128 FFT, and on a GPU float64 is slow and competes with training for
  memory, so it runs on the CPU backend unless a device is asked for."""
  return jax.default_device(jax.local_devices(backend="cpu")[0] if device is None else device)


def host_values(tree):
  """``tree``'s arrays as numpy arrays, whole: an array split across processes is gathered, so
  every process holds (and reports) the same values."""
  from jax.experimental import multihost_utils

  def whole(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
  return jax.tree_util.tree_map(whole, tree)


def cpu_threads(devices):
  """How many threads to dispatch independent programs from: on the CPU devices of one process,
  the cores each device leaves (XLA's CPU runtime runs these programs on about one core, and
  programs dispatched from several threads run side by side); else one (an accelerator runs
  one program at a time, and processes sharing a mesh must launch theirs in the same order)."""
  if jax.process_count() > 1 or any(device.platform != "cpu" for device in devices):
    return 1
  return max(1, (os.cpu_count() or 1) // len(devices))


def threaded_call(fn, *args, device=None):
  """``host_values(fn(*args))`` under float64, for a worker thread (the caller's scoped
  ``enable_x64`` and default device do not reach another thread: ``device``, where given, is
  the default device there)."""
  with jax.enable_x64(True), jax.default_device(device):  # (None: JAX's own default)
    return host_values(fn(*args))


def scoped_gradients(fn, nondiff_argnums=()):
  """``fn`` with its reverse-mode backward pass also run under a scoped ``enable_x64``.

  A scoped float64 forward pass is not enough for ``grad``: the backward pass runs after the
  scope has closed (when JAX transposes), where float64 would be silently truncated to float32.
  A ``custom_vjp`` whose fwd and bwd both enter the scope keeps every gradient in float64.

  Only what is differentiated is differentiated (symbolic zeros): inputs that are not
  (a step count stays a constant, so the PLD accountant's refusal to differentiate counts fires
  only when one is), and outputs that are not (the linearised function is transposed for the
  outputs whose cotangent is nonzero only, so an unused bound that is nan or +inf cannot turn a
  gradient of the estimate into nan).
  """

  def run(*args):
    with jax.enable_x64(True):
      return fn(*args)

  wrapped = jax.custom_vjp(run, nondiff_argnums=nondiff_argnums)
  is_primal = lambda x: isinstance(x, jax.custom_derivatives.CustomVJPPrimal)
  is_zero = lambda x: isinstance(x, jax.custom_derivatives.SymbolicZero)

  def fwd(*args):
    with jax.enable_x64(True):
      positions = [i for i in range(len(args)) if i not in nondiff_argnums]
      leaves, treedef = jax.tree_util.tree_flatten([args[i] for i in positions],
                                                   is_leaf=is_primal)
      values = [leaf.value for leaf in leaves]
      moving = [i for i, leaf in enumerate(leaves) if leaf.perturbed]

      def call(*moved):
        current = list(values)
        for i, value in zip(moving, moved):
          current[i] = value
        full = list(args)
        for i, arg in zip(positions, jax.tree_util.tree_unflatten(treedef, current)):
          full[i] = arg
        return fn(*full)

      primals = [values[i] for i in moving]
      out, linear = jax.linearize(call, *primals)
      shapes = [jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)) for p in primals]

    def back(linear, cotangent):  # (static structure closed over; ``linear`` is the residual)
      cts, _ = jax.tree_util.tree_flatten(cotangent, is_leaf=is_zero)
      keep = [i for i, c in enumerate(cts) if not is_zero(c)]

      def kept(*tangents):
        outs = jax.tree_util.tree_leaves(linear(*tangents))
        return [outs[i] for i in keep]

      grads = [None] * len(values)
      if keep:
        moved = jax.linear_transpose(kept, *shapes)([cts[i] for i in keep])
        for i, grad in zip(moving, moved):
          grads[i] = grad
      return tuple(jax.tree_util.tree_unflatten(treedef, grads))

    return out, jax.tree_util.Partial(back, linear)

  def bwd(*rest):
    residual, cotangent = rest[-2], rest[-1]
    with jax.enable_x64(True):
      cotangent = jax.tree_util.tree_map(
          lambda c: c if is_zero(c) or not jnp.issubdtype(c.dtype, jnp.floating)
          else c.astype(jnp.float64), cotangent, is_leaf=is_zero)
      return residual(cotangent)

  wrapped.defvjp(fwd, bwd, symbolic_zeros=True)

  @functools.wraps(fn)  # (a plain function: wraps would copy a custom_jvp's attributes onto it)
  def call(*args):
    return wrapped(*args)

  return call


# Composite Gauss-Legendre rule (fixed node count, so shapes are static): _GL_PANELS panels of
# _GL_ORDER nodes over the interval.
_GL_ORDER = 16
_GL_PANELS = 128
_GL_X, _GL_W = np.polynomial.legendre.leggauss(_GL_ORDER)


def _unit_rule(panels):
  """Nodes and weights of the composite rule on [0, 1] (numpy constants): a node set on [lo, hi]
  is then lo + (hi - lo) x, one multiply-add per node."""
  left = np.arange(panels)[:, None] / panels
  x = left + 0.5 * (1.0 + _GL_X)[None, :] / panels
  w = np.broadcast_to(0.5 * _GL_W / panels, (panels, _GL_ORDER))
  return x.reshape(-1), w.reshape(-1)


def composite_nodes(lo, hi, panels=None):
  """Nodes and weights of the composite Gauss-Legendre rule on [lo, hi] (arrays, traceable), with
  ``panels`` panels (static; default _GL_PANELS). Scaled from a constant rule on [0, 1]: built
  from iotas instead, the nodes fused into the loss computations kept XLA (CPU) from vectorising
  them (the batched saddle point ran ~25% slower)."""
  x, w = _unit_rule(_GL_PANELS if panels is None else panels)
  lo, hi = jnp.asarray(lo), jnp.asarray(hi)
  width = (hi - lo)[..., None]
  return lo[..., None] + width * x, width * w


def standard_normal_nodes(lo, hi, panels=None):
  """(log weight, u): a quadrature of N(0, 1) restricted to [lo, hi]. (The log of a weight is
  log(hi - lo) + log(w_j): one scalar log instead of one per node.)"""
  u, _ = composite_nodes(lo, hi, panels)
  _, w = _unit_rule(_GL_PANELS if panels is None else panels)
  log_w = jnp.log(jnp.asarray(hi) - lo)[..., None] + np.log(w)
  return log_w - 0.5 * u * u - 0.5 * np.log(2.0 * np.pi), u


def safe_where(cond, fn_true, fn_false, x):
  """``where(cond, fn_true(x), fn_false(x))`` whose unused branch never sees invalid inputs.

  Both functions are evaluated at a placeholder where their branch is not selected, so that neither
  values nor gradients of the discarded branch can be NaN (the "double where" idiom).
  """
  ones = jnp.ones_like(x)
  xt = jnp.where(cond, x, ones)
  xf = jnp.where(cond, ones, x)
  return jnp.where(cond, fn_true(xt), fn_false(xf))


def is_traced(tree) -> bool:
  """True when any leaf is a tracer (we are inside a caller's jit/vmap/grad)."""
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


_JITTED = []  # every program-compiling function of the package (see release_programs)
# Compiled programs kept before the package releases its own: every compiled XLA:CPU program keeps
# its own memory maps (a PLD program ~470), and past the kernel's vm.max_map_count (often 65530)
# the next compilation fails. A sweep over many plans in one process recompiles instead.
PROGRAM_BUDGET = 48


def fast_jit(fn, exported=None, quick=False, **kwargs):
  """``jax.jit`` at the top level; under a caller's transformation, ``fn`` itself.

  Under a caller's trace the caller compiles everything, and a nested jit would be re-traced by
  batching after the float64 scope has closed (``vmap(jit(f))``). (XLA's CPU option
  ``xla_cpu_use_fusion_emitters=False`` compiles ~25-40% faster and runs within ~15% either
  way. The looser upper, not monotone in delta, that its round-off exposed was measured to be
  a root Newton reached and then left by bisecting on round-off steps, which
  ``_solver.newton_in_bracket`` now ends on. The command line and the suite set it for their
  processes, ``cli.quick_compile_flags``; with ``quick`` a program that serves first answers
  sets it for itself, ``compile_cache.quick_options()``, read at its first call; with
  ``quick="one_answer"`` also the back end's lowest optimisation level, for a program that a
  process answering one question compiles and runs once.) The first
  top-level call turns on the persistent compilation cache (``compile_cache.enable``): the next
  process reads the programs back instead of compiling them. ``exported``, a name unique to
  ``fn`` (for positional arguments only): the next process also skips the tracing
  (``_exported``: a warm first answer's main cost).
  """
  made, lock = [], threading.Lock()

  def jitted_and_options():
    """The jitted ``fn`` and its compiler options, made at the first top-level call (then the
    backend, which ``quick_options`` asks for, is the one the call runs on)."""
    with lock:
      if not made:
        options = (compile_cache.quick_options(quick == "one_answer") if quick else {}) or None
        made.append((jax.jit(fn, compiler_options=options, **kwargs), options))
        _JITTED.append(made[0][0])
    return made[0]

  @functools.wraps(fn)
  def call(*args, **kw):
    if is_traced((args, kw)):
      return fn(*args, **kw)
    compile_cache.enable()
    release_programs()
    jitted, options = jitted_and_options()
    if exported and not kw:
      return _exported.call(exported, fn, jitted, args, options)
    return jitted(*args, **kw)

  def ahead(method):
    """``_exported``'s ``method`` for concrete arguments of an exported ``fn`` (else None),
    after the release a call makes first (so the call that follows releases nothing of it)."""
    def run(*args):
      if not exported or is_traced(args):
        return None
      release_programs()
      return method(exported, fn, args, jitted_and_options()[1])
    return run

  # ``call.output_specs(*args)``: the outputs' shapes from the export (None without one);
  # ``call.prepare(*args)``: the program for such arguments (values or shapes) compiled on a
  # thread of its own meanwhile.
  call.output_specs, call.prepare = ahead(_exported.output_specs), ahead(_exported.prepare)
  return call


def release_programs(budget=None):
  """Drops the package's own compiled programs (never the caller's) once more than ``budget``
  (default ``PROGRAM_BUDGET``) are held, so a process that plans many distinct grids stays within
  the kernel's memory-map limit. Results do not change: a dropped program is compiled again."""
  budget = PROGRAM_BUDGET if budget is None else budget
  if sum(jitted._cache_size() for jitted in _JITTED) + len(_exported.PROGRAMS) > budget:
    for jitted in _JITTED:
      jitted.clear_cache()
    for key, program in list(_exported.PROGRAMS.items()):
      if not isinstance(program, concurrent.futures.Future):  # (one compiling is kept)
        del _exported.PROGRAMS[key]
