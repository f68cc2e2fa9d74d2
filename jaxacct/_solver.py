"""The one solver module: every root an accountant (or calibration) finds is found here.

* ``newton_in_bracket``: safeguarded Newton on a sign bracket (rtsafe-style), elementwise over
  arrays, a static iteration budget.
* ``bracket_search``: grows a sign bracket from a guess and shrinks it by the Pegasus secant,
  in one loop that evaluates the function once per iteration (calibration: each value is a
  certified accountant, and the function is compiled once); on real or whole-number unknowns.
* ``bisect``: plain bisection of an increasing function (placing quadrature nodes; no gradient).
* ``furthest_holding`` and ``largest_whole``: on the host, where a predicate stops holding
  (calibration: the widest accuracy plan within a size budget, the last whole step that fits).
* ``implicit_root``: differentiates a root by the implicit-function theorem
  (``jax.lax.custom_root``), with a tangent solve for scalar, elementwise or vector roots.
* ``root_in_bracket``: ``newton_in_bracket`` plus ``implicit_root``, with the options the
  accountants need (the safe end of the final bracket for bounds, a coarse search polished on
  the exact residual).

Residuals are *decreasing* in the unknown (f(lo) >= 0 >= f(hi)); negate an increasing one.
A traced search reads its function through ``jax.jit``: the loop body, the shape pass and the
implicit root's residual then share one trace of it (JAX caches a jitted function's trace by
argument shapes) instead of each tracing a whole accountant again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


_ROUNDOFF_STEP = 1e-12  # a Newton step below this times (1 + |x|) is round-off: converged


def newton_in_bracket(value_and_slope, lo, hi, x0, iters=8, tol=0.0, settle=True):
  """Root of a decreasing function on [lo, hi] (f(lo) >= 0 >= f(hi)), safeguarded Newton.

  ``value_and_slope(x)`` returns (f(x), f'(x)); all of x, lo, hi may be arrays of one shape, each
  entry its own independent root. Each step takes the Newton step when it stays inside the
  current bracket and is at most half the step before last (as in rtsafe, so the bracket at
  least halves every two steps even where Newton crawls), and bisects otherwise; the bracket
  follows the sign of f. With ``settle``, a Newton step below ``_ROUNDOFF_STEP`` (1 + |x|)
  (round-off) is taken and ends the entry's search, its sign unevaluated (without, the halving
  rule bisects on such steps: a bracket Newton closed from one side is left with x far from the
  root). Without a sign change the iterates collapse onto the nearer end. At most
  ``iters`` steps (static shapes); it stops early once a step (Newton or bisection) moves x by at
  most ``tol`` (for arrays: once every entry has). With numpy arrays for lo, hi and x0 (and a
  numpy ``value_and_slope``) the same iteration runs on the host. Returns (x, lo, hi, converged,
  the slope last evaluated).
  """

  # numpy arrays (a planner's pass on the host) run on the host; anything else in JAX.
  host = all(isinstance(v, (np.ndarray, np.generic)) for v in (lo, hi, x0))
  xp = np if host else jnp

  def step(carry):
    i, floats, settled = carry
    x, a0, b0, last, before_last, slope = floats
    fx, dfx = value_and_slope(x)
    a = xp.where(fx >= 0.0, x, a0)
    b = xp.where(fx <= 0.0, x, b0)
    newton = x - fx / xp.where(dfx < 0.0, dfx, -1.0)
    # A converged step lands on (or a rounding error beyond) the bracket end it just moved: it
    # is kept, clamped, rather than replaced by a bisection that would undo the convergence.
    slack = 1e-3 * (b - a) + 4.0 * xp.finfo(x.dtype).eps * xp.abs(x)
    # A step below 1e-12 (1 + |x|) is the function's round-off (30-160 ulps of x where its
    # terms cancel, measured on the PLD's epsilon): x is the root.
    settles = settle & (dfx < 0.0) & (xp.abs(newton - x) <= _ROUNDOFF_STEP * (1.0 + xp.abs(x)))
    inside = ((dfx < 0.0) & (newton >= a - slack) & (newton <= b + slack)
              & ((xp.abs(newton - x) <= 0.5 * before_last) | settles))
    x_next = xp.where(inside, xp.clip(newton, a, b), 0.5 * (a + b))
    taken = xp.where(inside, xp.abs(newton - x), 0.5 * (b - a))
    done = (taken <= tol) | (fx == 0.0) | (inside & settles)
    # An entry that has converged stays put while others iterate: its next Newton step (round-off
    # noise) need not be below half of its last one, and a bisection would throw it away.
    # (The float state is one stacked array: XLA's CPU backend compiles each output of the loop
    # body as its own kernel; stacked, the default PLD program has 3 kernels fewer.)
    new = xp.stack([x_next, a, b, taken, last, dfx])
    return i + 1, xp.where(settled, floats, new), settled | done

  lo, hi, x0 = xp.broadcast_arrays(xp.asarray(lo), xp.asarray(hi), xp.asarray(x0))
  width = hi - lo
  floats = xp.stack([x0, lo, hi, width, width, xp.full(x0.shape, -1.0, x0.dtype)])
  carry = (0, floats, xp.zeros(x0.shape, bool))
  going = lambda c: (c[0] < iters) & ~xp.all(c[2])
  if xp is np:  # the same iteration, run on the host
    while going(carry):
      carry = step(carry)
  else:
    carry = jax.lax.while_loop(going, step, carry)
  _, (x, a, b, _, _, slope), done = carry
  return x, a, b, done, slope


# The first step of a bracket search that reads its length from the first value (``slope``),
# in log x: at least this, so that a start at the root still brackets it ...
_SHORTEST_FIRST_STEP = 1e-6
# ... and at most this (e^2: a far start, or no finite value there, then doubles as before).
_LONGEST_FIRST_STEP = 2.0


def bracket_search(evaluate, x0, *, step, lower, upper, iters=60, tol=0.0, whole=False,
                   ftol=None, safe_end="b", count=False, slope=None):
  """Root of a decreasing scalar function of x > 0, without a known bracket; values only.

  ``evaluate(x)`` returns (f(x), aux). From ``x0`` the search steps outwards in log x by
  ``step``, doubling, towards the root's side and within [``lower``, ``upper``], until f changes
  sign; then it shrinks the bracket [a, b] (f(a) >= 0 >= f(b)) by the Pegasus method: the
  secant point of the bracket in log x (the value kept at an end that survived twice is scaled
  by f(replaced) / (f(replaced) + f(new)), so convergence stays superlinear without the
  overshoot of Illinois's halving after a good step), the midpoint where that point is not
  finite or not inside; with ``ftol`` the secant aims at the middle of the safe side's band. One
  evaluation per iteration, at most ``iters``; it stops once b - a <= ``tol`` * b (``whole``: x
  is a whole number, points are rounded, and it stops at b - a <= 1), or once a point evaluated
  on the ``safe_end``'s side ("b": f <= 0, "a": f >= 0) has |f| <= ``ftol`` (that end is then as
  good as the root: one-sided answers need no narrow bracket). Traceable, no gradient (wrap it in
  ``implicit_root`` for one).

  With a numpy ``x0`` (an array of independent searches) the same iteration runs on the host,
  ``evaluate`` called once per iteration on every search's point (a batch: one call of a
  compiled accountant), each search frozen once it stops, until all have.

  Returns (a, b, aux at a, aux at b, found): both ends evaluated where ``found``; otherwise the
  search reached the end of the domain without a sign change (the function keeps one sign).
  ``count``: the number of evaluations read is appended (what the search cost). ``slope``: a
  least |f'| in log x; the first step is then |f(x0)| / ``slope`` (within [1e-6, 2]), which
  reaches the root where f falls at least that fast, instead of ``step``.
  """
  host = isinstance(x0, (np.ndarray, np.generic))
  xp = np if host else jnp
  x0 = xp.asarray(x0, np.float64 if host else jnp.result_type(float))
  lower, upper = xp.asarray(lower, x0.dtype), xp.asarray(upper, x0.dtype)
  snap = xp.round if whole else (lambda x: x)

  def narrow(a, b):
    return (b - a <= 1.0) if whole else (b - a <= tol * b)

  def update(c, fx, aux):
    x = c["x"]
    right = fx >= 0.0  # the root lies at or above x
    zero = fx == 0.0   # (then x is both ends)
    have_a, have_b = c["have_a"] | right, c["have_b"] | ~right | zero
    # Pegasus: an end kept twice in a row (kept: +1 = b, -1 = a) has its value scaled by
    # f(replaced) / (f(replaced) + f(new)), in (0, 1): ~1 after a large step towards the root,
    # ~1/2 (Illinois) where the other end creeps.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
      scale_a = xp.where(~right & (c["kept"] < 0), c["fb"] / (c["fb"] + fx), 1.0)
      scale_b = xp.where(right & (c["kept"] > 0), c["fa"] / (c["fa"] + fx), 1.0)
      fa = c["fa"] * xp.where(scale_a > 0.0, scale_a, 0.5)
      fb = c["fb"] * xp.where(scale_b > 0.0, scale_b, 0.5)
    a, fa = xp.where(right, x, c["a"]), xp.where(right, fx, fa)
    b, fb = xp.where(right & ~zero, c["b"], x), xp.where(right & ~zero, fb, fx)
    aux_a = jax.tree_util.tree_map(lambda n, o: _where(xp, right, n, o), aux, c["aux_a"])
    aux_b = jax.tree_util.tree_map(lambda n, o: _where(xp, right & ~zero, o, n), aux, c["aux_b"])
    # Next point: outwards while one end is missing, else the bracket's secant point.
    first = step
    if slope is not None:  # (the first evaluation sets each search's step)
      with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        reach = xp.abs(fx) / slope
      reach = xp.clip(xp.where(xp.isfinite(reach), reach, _LONGEST_FIRST_STEP),
                      _SHORTEST_FIRST_STEP, _LONGEST_FIRST_STEP)
      first = xp.where(c["i"] == 0, reach, c["step"])
    grow = xp.exp(xp.where(right, 1.0, -1.0) * first * 2.0 ** c["k"])
    out = snap(x * grow)
    if whole:  # (at least one whole step)
      out = xp.where(right, xp.maximum(out, x + 1.0), xp.minimum(out, x - 1.0))
    out = xp.clip(out, lower, upper)
    # (with ``ftol`` the secant aims at the middle of the safe side's band, f = -+ftol/2, so
    # that a secant point close enough is also on that side: the search stops there)
    aim = 0.0 if ftol is None else (-0.5 if safe_end == "b" else 0.5) * ftol
    with np.errstate(divide="ignore", invalid="ignore"):
      la, lb = xp.log(a), xp.log(b)
      secant = snap(xp.exp(la + (fa - aim) / (fa - fb) * (lb - la)))
    mid = xp.floor(0.5 * (a + b)) if whole else xp.exp(0.5 * (la + lb))
    inside = xp.isfinite(secant) & (secant > a) & (secant < b)
    both = have_a & have_b
    x_next = xp.where(both, xp.where(inside, secant, mid), out)
    stuck = ~both & (out == x)  # at the end of the domain, no sign change
    stop = (both & narrow(a, b)) | zero | stuck
    if ftol is not None:
      on_safe_side = ~right if safe_end == "b" else right
      stop = stop | (both & on_safe_side & (xp.abs(fx) <= ftol))
    state = dict(i=c["i"] + 1, x=x_next, a=a, b=b, fa=fa, fb=fb, aux_a=aux_a, aux_b=aux_b,
                 have_a=have_a, have_b=have_b, k=xp.where(both, c["k"], c["k"] + 1.0),
                 kept=xp.where(both, xp.where(right, 1, -1), 0).astype(np.int32), stop=stop)
    return state if slope is None else dict(state, step=first)

  def start(aux0):
    no = xp.zeros(x0.shape, bool)
    state = dict(i=xp.zeros(x0.shape, np.int32), x=snap(x0), a=x0, b=x0, fa=xp.zeros_like(x0),
                 fb=xp.zeros_like(x0), aux_a=aux0, aux_b=aux0, have_a=no, have_b=no,
                 k=xp.zeros_like(x0), kept=xp.zeros(x0.shape, np.int32), stop=no)
    return state if slope is None else dict(state, step=xp.full(x0.shape, step, x0.dtype))

  zeros = lambda tree: jax.tree_util.tree_map(lambda s: xp.zeros(s.shape, s.dtype), tree)
  if host:  # (the first values give the aux's shapes)
    fx, aux = evaluate(snap(x0))
    c = update(start(zeros(aux)), np.asarray(fx), aux)
    while np.any(going := (c["i"] < iters) & ~c["stop"]):
      fx, aux = evaluate(c["x"])
      new = update(c, np.asarray(fx), aux)
      c = jax.tree_util.tree_map(lambda n, o, going=going: _where(np, going, n, o), new, c)
  else:
    evaluate = jax.jit(evaluate)  # traced once: the shapes' pass and the loop body share it
    aux0 = zeros(jax.eval_shape(lambda x: evaluate(x)[1], x0))
    c = jax.lax.while_loop(lambda c: (c["i"] < iters) & ~c["stop"],
                           lambda c: update(c, *evaluate(c["x"])), start(aux0))
  out = c["a"], c["b"], c["aux_a"], c["aux_b"], c["have_a"] & c["have_b"]
  return out + (c["i"],) if count else out


def _where(xp, condition, new, old):
  """``xp.where`` with ``condition`` [n] over leaves [n, ...] (a batch's aux on the host)."""
  extra = xp.ndim(new) - xp.ndim(condition)
  return xp.where(xp.reshape(condition, xp.shape(condition) + (1,) * extra), new, old)


def bisect(increasing, lo, hi, steps=30):
  """(lo, hi) after ``steps`` halvings of a bracket of an increasing function (elementwise):
  ``increasing(lo) <= 0 <= increasing(hi)`` is kept. No gradient flows (it places nodes)."""
  lo, hi = jax.lax.stop_gradient(lo), jax.lax.stop_gradient(hi)

  def halve(_, ends):
    a, b = ends
    mid = 0.5 * (a + b)
    right = increasing(mid) >= 0.0
    return jnp.where(right, a, mid), jnp.where(right, mid, b)

  return jax.lax.fori_loop(0, steps, halve, (lo, hi))


def bisect_whole(read, above, ends):
  """Adjacent whole numbers lo, hi = lo + 1 between which a monotone predicate stops holding,
  by bisection of ``ends`` = (lo, read(lo), hi, read(hi)) with ``above(read(lo))`` true and
  ``above(read(hi))`` false (ends taken as given, unchecked). Each end carries what ``read``
  returned there (a pytree), so a caller has its values at the crossing without reading them
  again. Halves until the ends are adjacent (a while loop: a bracket found near its answer costs
  a few reads, not a fixed count); integer ends always shrink, so it stops (after at most
  log2(hi - lo) + 1 reads, also where reads are nan). No gradient flows (it places a cell)."""
  def halve(ends):
    lo, at_lo, hi, at_hi = ends
    mid = (lo + hi) // 2
    at_mid = read(mid)
    up = above(at_mid)
    pick = lambda a, b: jax.tree_util.tree_map(lambda x, y: jnp.where(up, x, y), a, b)
    return jnp.where(up, mid, lo), pick(at_mid, at_lo), jnp.where(up, hi, mid), pick(at_hi,
                                                                                       at_mid)

  return jax.lax.while_loop(lambda ends: ends[2] - ends[0] > 1, halve, ends)


def furthest_holding(holds, good, bad, steps=6, geometric=False):
  """The point of [good, bad] nearest ``bad`` at which the host predicate ``holds`` was seen
  true, after ``steps`` halvings (of the log span where ``geometric``): ``holds(good)`` is
  assumed, and holds on one side of a single threshold. No tracing, no gradient."""
  for _ in range(steps):
    mid = float(np.sqrt(good * bad)) if geometric else 0.5 * (good + bad)
    good, bad = (mid, bad) if holds(mid) else (good, mid)
  return good


def largest_whole(fits, start, stride, lower, upper, reads=200):
  """The largest whole x in [lower, upper] with ``fits(x)`` (a host predicate over arrays,
  elementwise, true up to a threshold), found from ``start`` by strides of ``stride`` (>= 1)
  away from it, doubling, until the threshold is bracketed, then by halving on whole numbers:
  each array of probes is read once, ~log2(distance / stride) + log2(stride) + 2 reads.
  ``lower - 1`` where nothing fits; None where ``reads`` ran out (``fits`` not monotone)."""
  start = np.asarray(start, np.float64)
  here = fits(start)
  good = np.where(here, start, lower - 1.0)  # the largest x known to fit (lower - 1: none yet)
  bad = np.where(here, np.inf, start)        # the smallest x known not to (inf: none yet)
  stride = np.maximum(1.0, np.floor(np.asarray(stride, np.float64)))
  for _ in range(reads):
    open_ = bad - good > 1.0
    if not np.any(open_):
      return good
    up, down = ~np.isfinite(bad), good < lower
    probe = np.where(up, np.minimum(good + stride, upper + 1.0),
                     np.where(down, np.maximum(bad - stride, lower), np.floor(0.5 * (good + bad))))
    probe = np.where(open_, probe, good)
    ok = fits(np.minimum(probe, upper)) & (probe <= upper)
    good = np.where(open_ & ok, probe, good)
    bad = np.where(open_ & ~ok, probe, bad)
    stride = np.where(open_ & (up | down), 2.0 * stride, stride)
  return None


def _tangent_solve(structure):
  """The linear solve of the implicit-function theorem: given g = d residual / d x (a linear map)
  and y, x with g(x) = y. "elementwise": independent scalar roots stacked in an array (g is
  diagonal: one evaluation gives it); "dense": a vector root (a joint solve of several
  unknowns: g's Jacobian by forward mode, then a dense solve)."""
  if structure == "elementwise":
    return lambda g, y: y / g(jnp.ones_like(y))

  def dense(g, y):
    flat = jnp.ravel(y)
    jacobian = jax.jacfwd(lambda v: jnp.ravel(g(v.reshape(jnp.shape(y)))))(flat)
    return jnp.linalg.solve(jacobian, flat).reshape(jnp.shape(y))

  return dense


def implicit_root(residual, solve, guess, has_aux=False, structure="elementwise"):
  """The root of ``residual`` found by ``solve(residual, guess)``, differentiated implicitly.

  Gradients with respect to anything ``residual`` closes over follow the implicit-function
  theorem d x / d theta = -(d f / d x)^{-1} d f / d theta, never the solver's iterations (so
  second derivatives are right too). ``structure``: "elementwise" for a scalar root or an array of
  independent ones, "dense" for a vector root of a joint system. With ``has_aux`` the solver
  returns (root, aux) and so does this (aux without gradients).
  """
  return jax.lax.custom_root(residual, guess, solve, _tangent_solve(structure), has_aux=has_aux)


def root_in_bracket(residual, lo, hi, iters, which=0, tol=0.0, start=None, coarse=None,
                    polish=1):
  """Root of a decreasing scalar ``residual`` in [lo, hi] (safeguarded Newton from ``start``,
  default the midpoint, at most ``iters`` steps, stopping at steps below ``tol``), differentiated
  implicitly.

  ``coarse``: a cheaper approximation of ``residual`` (e.g. a smaller quadrature) that the
  bracketed search runs on; ``polish`` Newton steps then remove its error, each reading the value
  of ``residual`` itself and the slope the search last read from ``coarse`` (a slope off by a
  relative r leaves r times the error: a coarse root within 1e-6 of the exact one, with a slope
  within 1e-6, is within ~1e-12 after one step).

  ``which`` picks what is returned: 0 the Newton point; +1 the bracket end where residual <= 0,
  -1 the end where residual >= 0 (a point whose sign was evaluated: the safe ends for upper and
  lower bounds), or the Newton point where it converged (callers then check its sign). May be
  traced.

  Returns (root, the slope the search last read; no gradient).
  """

  # Traced once: the implicit root's residual, the search's jvp and the polish read one trace.
  residual = jax.jit(residual)
  coarse = None if coarse is None else jax.jit(coarse)
  # Forward mode: one tangent for a scalar function is cheaper than a reverse pass.
  slope_of = lambda fn: (lambda x: jax.jvp(fn, (x,), (jnp.ones_like(x),)))

  def solve(_, __):
    x0 = 0.5 * (lo + hi) if start is None else start
    search = residual if coarse is None else coarse
    # (no settling: the safe ends returned where it has not converged are evaluated points)
    x, a, b, converged, slope = newton_in_bracket(slope_of(search), lo, hi, x0, iters, tol,
                                                  settle=False)

    def polish_step(_, x):
      step = jnp.clip(x - residual(x) / jnp.where(slope < 0.0, slope, -1.0), lo, hi)
      return jnp.where(converged & (slope < 0.0), step, x)

    if coarse is not None:  # a loop, not unrolled: one copy of the residual to compile
      x = jax.lax.fori_loop(0, polish, polish_step, x)
    end = jnp.where(which > 0, b, jnp.where(which < 0, a, x))
    return jnp.where(converged, x, end), slope

  return implicit_root(residual, solve, jnp.zeros(()), has_aux=True)
