"""The one solver module: safeguarded Newton, bracket search, implicit gradients (scalar,
elementwise and vector roots), against closed-form roots and central differences."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxacct import _solver
from jaxacct._solver import (bisect, bracket_search, furthest_holding, implicit_root,
                             largest_whole, newton_in_bracket, root_in_bracket)


@pytest.fixture(autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


def test_newton_in_bracket_converges_early_and_collapses_without_a_sign_change():
  f = lambda x: jnp.exp(-x) - 0.3  # decreasing, root log(1/0.3)
  slope = lambda x: (f(x), -jnp.exp(-x))
  x, lo, hi, done, last_slope = newton_in_bracket(slope, -5.0, 5.0, 0.0, iters=50, tol=1e-12)
  assert bool(done) and float(x) == pytest.approx(math.log(1 / 0.3), abs=1e-12)
  assert float(lo) <= float(x) <= float(hi)
  assert float(last_slope) == pytest.approx(-0.3, rel=1e-9)  # read at the last step's start
  # A bracket without a sign change (f > 0 throughout) collapses onto its right end.
  x, *_ = newton_in_bracket(slope, -5.0, 1.0, -2.0, iters=60, tol=1e-12)
  assert float(x) == pytest.approx(1.0, abs=1e-9)


def test_newton_in_bracket_is_elementwise():
  targets = jnp.array([0.9, 0.3, 1e-6, 1e-200])
  slope = lambda x: (jnp.exp(-x) - targets, -jnp.exp(-x))
  x, *_ = newton_in_bracket(slope, jnp.zeros(4), jnp.full(4, 600.0), jnp.full(4, 1.0), iters=200,
                            tol=1e-13)
  np.testing.assert_allclose(np.asarray(x), -np.log(np.asarray(targets)), rtol=1e-12)


def test_newton_in_bracket_runs_on_the_host_for_numpy_inputs():
  """The planner's pass calls models with numpy values: the same iteration runs in numpy (no
  compiled program) and finds the same roots."""
  targets = np.array([0.9, 0.3, 1e-6])
  slope = lambda x: (np.exp(-x) - targets, -np.exp(-x))
  x, lo, hi, done, _ = newton_in_bracket(slope, np.zeros(3), np.full(3, 50.0), np.ones(3),
                                         iters=100, tol=1e-14)
  assert isinstance(x, np.ndarray) and bool(np.all(done))
  np.testing.assert_allclose(x, -np.log(targets), rtol=1e-13)


def test_root_in_bracket_implicit_gradient_polish_and_safe_ends():
  theta = 2.7
  cube_root = lambda t: root_in_bracket(lambda x: t - x ** 3, 0.0, 4.0, 60, tol=1e-14)
  assert float(cube_root(theta)[0]) == pytest.approx(theta ** (1 / 3), rel=1e-12)
  # The slope the search last read (at a point within 1e-14 of the root): -3 x^2.
  assert float(cube_root(theta)[1]) == pytest.approx(-3.0 * theta ** (2 / 3), rel=1e-9)
  first = jax.grad(lambda t: cube_root(t)[0])
  assert float(first(theta)) == pytest.approx(theta ** (-2 / 3) / 3, rel=1e-10)
  # Second order through the implicit rule (no iterations differentiated).
  second = jax.grad(first)
  assert float(second(theta)) == pytest.approx(-2.0 / 9.0 * theta ** (-5 / 3), rel=1e-9)
  # A search on a coarse approximation (root off by ~3e-8), then one polish step that reads the
  # exact value and the coarse slope: the exact root and the exact implicit gradient.
  polished = lambda t: root_in_bracket(
      lambda x: t - x ** 3, 0.0, 4.0, 60, tol=1e-6,
      coarse=lambda x: t * (1.0 + 1e-7) - x ** 3 * (1.0 + 1e-8))[0]
  assert float(polished(theta)) == pytest.approx(theta ** (1 / 3), rel=1e-13)
  assert float(jax.grad(polished)(theta)) == pytest.approx(theta ** (-2 / 3) / 3, rel=1e-10)
  # The bracket ends are returned for bounds when Newton has not converged (here: no steps).
  residual = lambda x: 1.0 - x
  assert float(root_in_bracket(residual, 0.0, 3.0, 1, which=1, tol=1e-14)[0]) == 1.5
  assert float(root_in_bracket(residual, 0.0, 3.0, 1, which=-1, tol=1e-14)[0]) == 0.0


@pytest.mark.parametrize("target", [1e-12, 3.7e-9, 1e-5, 0.42, 1.0, 17.0, 1e3])
@pytest.mark.parametrize("guess", [1e-3, 1.0, 50.0])
def test_bracket_search_finds_roots_over_fifteen_decades(target, guess):
  """Monotone functions with roots from 1e-12 to 1e3, searched from guesses on either side."""
  for f in (lambda x: jnp.log(target) - jnp.log(x),          # root at target, log-like
            lambda x: target ** 0.5 - jnp.sqrt(x),           # root at target, power-like
            lambda x: jnp.tanh(target - x)):                  # saturating, linear near its root
    a, b, *_, found = jax.jit(lambda x0: bracket_search(
        lambda x: (f(x), x), x0, step=1.0, lower=1e-15, upper=1e6, iters=100, tol=1e-14))(guess)
    assert bool(found)
    assert float(f(a)) >= 0.0 >= float(f(b))
    assert float(a) == pytest.approx(target, rel=1e-10)


@pytest.mark.parametrize("target", [1e-12, 3.7e-9, 1e-5, 0.42, 1.0, 17.0, 1e3])
def test_secant_bracket_search_values_only(target):
  """``bracket_search`` (grow, then Illinois) on decreasing functions with roots over fifteen
  decades: both returned ends evaluated on their sides, the bracket within its tolerance, in
  few evaluations, with the evaluations' aux carried for each end."""
  calls = []
  for f in (lambda x: jnp.log(target) - jnp.log(x), lambda x: jnp.tanh(target - x),
            lambda x: target ** 0.5 - jnp.sqrt(x)):
    evaluate = lambda x: (f(x), 2.0 * x)
    a, b, aux_a, aux_b, found = jax.jit(lambda x0: bracket_search(
        evaluate, x0, step=0.5, lower=1e-15, upper=1e6, tol=1e-12))(1.0)
    assert bool(found)
    assert float(f(a)) >= 0.0 >= float(f(b))
    assert float(b - a) <= 1e-12 * float(b)
    assert float(a) == pytest.approx(target, rel=1e-11)
    assert float(aux_a) == 2.0 * float(a) and float(aux_b) == 2.0 * float(b)
    calls.append(f)
  assert len(calls) == 3


@pytest.mark.parametrize("safe_end", ["a", "b"])
def test_secant_bracket_search_stops_when_the_safe_end_is_close(safe_end):
  """With ``ftol`` the search stops once a point on the safe end's side has |f| <= ftol: that
  end is then within ftol of the root (in f), on its side."""
  f = lambda x: jnp.log(0.3) - jnp.log(x)   # root 0.3; f = -log(x / 0.3)
  counted = lambda **kw: bracket_search(lambda x: (f(x), x), 1.0, step=0.5, lower=1e-9,
                                        upper=1e3, tol=1e-13, **kw)
  a, b, at_a, at_b, found = counted(ftol=1e-4, safe_end=safe_end)
  assert bool(found)
  end = float(a if safe_end == "a" else b)
  value = float(f(end))
  assert (0.0 <= value <= 1e-4) if safe_end == "a" else (-1e-4 <= value <= 0.0)
  assert float(at_a) == float(a) and float(at_b) == float(b)
  # Without it the bracket is narrowed to tol (the same ends' sides, the root to 1e-12).
  a, b, *_ = counted()
  assert float(b - a) <= 1e-12 and float(f(a)) >= 0.0 >= float(f(b))


def test_secant_bracket_search_whole_numbers_and_no_sign_change():
  f = lambda x: 1234.4 - x
  a, b, *_, found = bracket_search(lambda x: (f(x), x), 10.0, step=0.3, lower=1.0, upper=1e7,
                                   whole=True)
  assert bool(found) and float(a) == 1234.0 and float(b) == 1235.0
  # No sign change within the domain: not found, the search stops at the domain's end.
  a, b, *_, found = bracket_search(lambda x: (5.0 - x, x), 0.5, step=0.1, lower=0.1, upper=1.0)
  assert not bool(found)
  a, b, *_, found = bracket_search(lambda x: (f(x), x), 3.0, step=0.3, lower=1.0, upper=100.0,
                                   whole=True)
  assert not bool(found)


@pytest.mark.parametrize("host", [True, False])
def test_a_first_step_sized_by_the_least_slope_brackets_in_one_step(host):
  """With ``slope`` (a least |f'| in log x) the first step is |f(x0)| / slope: on functions that
  fall at least that fast it reaches the root or past it, so a close start is bracketed by its
  first step and the search needs fewer values than with the fixed step (the same roots, on the
  safe end's side within ftol); a start far off or with no finite value still finds it. The
  host's (numpy, a batch) and the compiled (vmapped) searches agree."""
  roots = np.array([1.0004, 1.012, 0.97, 1.0 + 1e-9, 40.0, 1e-3])
  steepness = np.array([1.0, 1.7, 3.0, 2.0, 1.2, 1.0])

  def search(root, steep, **kw):
    xp = np if host else jnp
    def evaluate(x):  # decreasing, slope -steep in log x, +inf far below the root's side
      return xp.where(x < 1e-3 * root, xp.inf, steep * (xp.log(root) - xp.log(x))), x
    _, b, _, _, found, reads = bracket_search(
        evaluate, xp.ones_like(root), step=0.01, lower=1e-9, upper=1e6, tol=1e-12, ftol=1e-6,
        safe_end="b", count=True, **kw)
    return b, found, reads

  run = (lambda **kw: search(roots, steepness, **kw)) if host else (
      lambda **kw: jax.vmap(lambda r, s: search(r, s, **kw))(roots, steepness))
  fixed_b, fixed_found, fixed_reads = (np.asarray(v) for v in run())
  b, found, reads = (np.asarray(v) for v in run(slope=1.0))
  assert found.all() and fixed_found.all()
  for ends in (b, fixed_b):  # the safe end: f <= 0 within ftol, i.e. at or just above each root
    assert np.all(ends >= roots) and np.all(np.log(ends / roots) * steepness <= 1e-6)
  assert reads[0] <= 3 and reads[3] <= 3, reads  # close starts: bracketed by the first step
  assert np.sum(reads) < np.sum(fixed_reads), (reads, fixed_reads)
  # A start with no finite value (f = +inf: no bound there) takes the longest first step, e^2.
  b, found = (np.asarray(v) for v in bracket_search(
      lambda x: (np.where(x < 0.5, np.inf, np.log(0.7) - np.log(x)), x), np.array([0.2]),
      step=0.01, lower=np.array([1e-9]), upper=np.array([1e6]), tol=1e-12, slope=1.0)[1:5:3])
  assert found.all() and b == pytest.approx(0.7, rel=1e-11)


def _central(f, x, h):
  return (f(x + h) - f(x - h)) / (2.0 * h)


@pytest.mark.parametrize("a", [0.3, 2.0, 40.0])
def test_implicit_gradients_match_central_differences(a):
  """x(a) solves x e^x = a (Lambert W): first and second derivatives, 1e-6 relative."""
  def x_of(a):
    residual = lambda x: a - x * jnp.exp(x)
    solve = lambda _, __: bracket_search(lambda x: (residual(x), x), 1.0, step=0.5, lower=1e-9,
                                         upper=1e3, iters=100, tol=1e-15)[1]
    return implicit_root(residual, solve, jnp.ones(()))
  d1 = jax.grad(x_of)
  d2 = jax.grad(d1)
  h = 1e-4 * a
  assert float(d1(a)) == pytest.approx(float(_central(x_of, a, h)), rel=1e-6)
  assert float(d2(a)) == pytest.approx(float(_central(d1, a, h)), rel=1e-6)
  w = float(x_of(a))  # closed form: W'(a) = W / (a (1 + W))
  assert float(d1(a)) == pytest.approx(w / (a * (1.0 + w)), rel=1e-12)


def test_elementwise_roots_have_elementwise_gradients():
  a = jnp.array([0.5, 2.0, 9.0])

  def roots(a):
    f = lambda x: a - x ** 3
    solve = lambda fn, g: newton_in_bracket(lambda x: jax.jvp(fn, (x,), (jnp.ones_like(x),)),
                                            jnp.zeros(3), jnp.full(3, 5.0), g, 80, 1e-15)[0]
    return implicit_root(f, solve, jnp.ones(3))

  jac = jax.jacfwd(roots)(a)
  np.testing.assert_allclose(np.diag(np.asarray(jac)), np.asarray(a) ** (-2 / 3) / 3, rtol=1e-10)
  assert np.count_nonzero(np.asarray(jac) - np.diag(np.diag(np.asarray(jac)))) == 0


def test_vector_tangent_solve_for_a_joint_root():
  """(x, y) solving x^2 + y = a, x - y^3 = b: the implicit Jacobian d(x, y)/d(a, b) is the
  inverse of the system's Jacobian, and matches central differences."""

  def joint(params):
    a, b = params[0], params[1]
    f = lambda v: jnp.stack([a - v[0] ** 2 - v[1], v[0] - v[1] ** 3 - b])

    def solve(fn, v):  # a few Newton steps on the 2x2 system (any solver: only the root matters)
      for _ in range(40):
        v = v - jnp.linalg.solve(jax.jacfwd(fn)(v), fn(v))
      return v

    return implicit_root(f, solve, jnp.array([1.0, 1.0]), structure="dense")

  params = jnp.array([3.0, 0.5])
  v = joint(params)
  x, y = float(v[0]), float(v[1])
  assert x * x + y == pytest.approx(3.0, abs=1e-12) and x - y ** 3 == pytest.approx(0.5, abs=1e-12)
  jac = np.asarray(jax.jacfwd(joint)(params))
  system = np.array([[-2 * x, -1.0], [1.0, -3 * y * y]])  # d f / d (x, y)
  expected = -np.linalg.solve(system, np.diag([1.0, -1.0]))  # d f / d (a, b) = diag(1, -1)
  np.testing.assert_allclose(jac, expected, rtol=1e-10)
  h = 1e-6
  fd = np.stack([(np.asarray(joint(params + h * e)) - np.asarray(joint(params - h * e))) / (2 * h)
                 for e in np.eye(2)], axis=1)
  np.testing.assert_allclose(jac, fd, rtol=1e-6)
  # Reverse mode through the same rule.
  g = jax.grad(lambda p: joint(p)[0] * joint(p)[1])(params)
  np.testing.assert_allclose(np.asarray(g), y * jac[0] + x * jac[1], rtol=1e-10)


def test_bisect_keeps_its_bracket():
  lo, hi = bisect(lambda u: u ** 3 - 2.0, jnp.array([0.0, 1.0]), jnp.array([5.0, 2.0]), 50)
  np.testing.assert_allclose(np.asarray(lo), 2.0 ** (1 / 3), rtol=1e-13)
  assert np.all(np.asarray(lo) <= 2.0 ** (1 / 3)) and np.all(np.asarray(hi) >= 2.0 ** (1 / 3))


def test_no_other_newton_loop_in_the_package():
  """Every root the accountants find goes through the solver module: no other module runs its own
  Newton iteration or bisection (the signatures of one)."""
  import pathlib
  import re
  package = pathlib.Path(_solver.__file__).parent
  pattern = re.compile(r"while_loop|newton = |mid = 0\.5")
  offenders = [str(path.relative_to(package)) for path in package.rglob("*.py")
               if path.name != "_solver.py" and pattern.search(path.read_text())]
  assert offenders == []


def test_host_searches_find_where_a_predicate_stops_holding():
  """``furthest_holding`` keeps its bracket (arithmetic and geometric halvings);
  ``largest_whole`` finds each element's last whole number from starts on either side, far
  away (strides double), at the domain's ends, and where nothing fits."""
  edge = 0.3
  x = furthest_holding(lambda v: v <= edge, 0.0, 1.0, steps=20)
  assert x <= edge < x + 2.0 ** -20
  x = furthest_holding(lambda v: v <= 7.0, 1.0, 100.0, steps=30, geometric=True)
  assert x <= 7.0 < x * 100.0 ** (2.0 ** -30) + 1e-12
  threshold = np.array([5.0, 123456.0, 1.0, 1e7, 0.0, 40.0])
  start = np.array([5.0, 3.0, 900.0, 2.0, 10.0, 1e6])
  reads = []

  def fits(t):
    reads.append(t)
    return t <= threshold

  last = largest_whole(fits, start, 1.0, 1.0, 1e7)
  np.testing.assert_array_equal(last, [5.0, 123456.0, 1.0, 1e7, 0.0, 40.0])
  assert len(reads) < 60  # (galloping: ~2 log2 of the distance, not one read per step)
  assert largest_whole(lambda t: t <= 1e6, np.array([1.0]), 1.0, 1.0, 1e7, reads=5) is None


@pytest.mark.parametrize("level, first", [(0.0, 500), (3.3, 335), (9.99, 1), (-9.99, 1000)])
def test_whole_bisection_carries_each_ends_reads(level, first):
  """``bisect_whole`` stops at adjacent ends around the first whole number where a decreasing
  sequence falls to a level, each end holding its own read (carried, not read again); reads
  that are nan still end it."""
  values = jnp.asarray(np.linspace(10.0, -10.0, 1001))
  read = lambda b: (values[b], 3 * b)
  above = lambda at: at[0] > level
  ends = (jnp.asarray(0), read(0), jnp.asarray(1000), read(1000))
  with jax.enable_x64(True):
    lo, at_lo, hi, at_hi = jax.jit(lambda e: _solver.bisect_whole(read, above, e))(ends)
  assert (int(lo), int(hi)) == (first - 1, first)
  assert float(at_lo[0]) == float(values[first - 1]) and int(at_lo[1]) == 3 * (first - 1)
  assert float(at_hi[0]) == float(values[first]) and int(at_hi[1]) == 3 * first
  nan_read = lambda b: (jnp.nan * b, b)
  lo, _, hi, _ = _solver.bisect_whole(nan_read, above, (jnp.asarray(0), nan_read(0),
                                                        jnp.asarray(1000), nan_read(1000)))
  assert (int(lo), int(hi)) == (0, 1)
