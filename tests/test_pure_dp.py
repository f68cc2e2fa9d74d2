"""Bounded losses (Laplace, randomized response, (epsilon, delta)): delta at and beyond the
composed loss's top is exact in the certified upper, and the upper stays above the truth
everywhere else.

A model that bounds its loss (``max_loss``) bounds the composed finite loss by the steps' sum;
from there on delta is exactly P(L = inf) (0 for pure DP), and below it the upper may use
P(inf) + P(finite) (1 - e^{eps - top}) (``jaxacct.pld.query``). The truth here is exact:
enumerated atoms in 40-digit arithmetic (randomized response, (epsilon, delta), their Poisson
subsampling), checked against the optimal composition theorem (Kairouz, Oh and Viswanath 2015,
Thm 3.3), and Laplace by quadrature of its loss law (to ~1e-15).
"""

import math

import jax
import jax.numpy as jnp
import mpmath as mp
import numpy as np
import pytest
from scipy import integrate

import jaxacct
from jaxacct.models import RandomizedResponse
from jaxacct.pld import query

mp.mp.dps = 40
FLOOR = 1e-12  # delta at and beyond the top: exact up to float64 round-off, far below this


# ---------------------------------------------------------------- exact references (40 digits)

def _ed_atoms(e0, d0):
  """(epsilon, delta) step: finite atoms under P (sub-probability: delta sits at +inf)."""
  e0, d0 = mp.mpf(e0), mp.mpf(d0)
  return [(e0, (1 - d0) / (1 + mp.exp(-e0))), (-e0, (1 - d0) / (1 + mp.exp(e0)))]


def _rr_atoms(p, k):
  """k-ary randomized response (replace-one): +e0, 0, -e0."""
  p, k = mp.mpf(p), mp.mpf(k)
  e0 = mp.log(1 + k * (1 - p) / p)
  return [(e0, 1 - p + p / k), (mp.mpf(0), (k - 2) * p / k), (-e0, p / k)]


def _sampled_ed_atoms(e0, d0, q, add):
  """Poisson-subsampled (epsilon, delta) step, one direction: L = f(Z) = log(1 - q + q e^Z) under
  q B1 + (1 - q) B0 (remove), -f(Z) under B0 (add); B0's delta atom at Z = -inf gives
  L = log(1 - q) (remove, mass (1 - q) delta) and -log(1 - q) (add, mass delta)."""
  e0, d0, q = mp.mpf(e0), mp.mpf(d0), mp.mpf(q)
  f = lambda z: mp.log(1 - q + q * mp.exp(z))
  up, down = (1 - d0) / (1 + mp.exp(-e0)), (1 - d0) / (1 + mp.exp(e0))
  b1 = {e0: up, -e0: down}
  b0 = {e0: down, -e0: up}
  if add:
    return [(-f(z), b0[z]) for z in (e0, -e0)] + [(-mp.log(1 - q), d0)]
  return [(f(z), q * b1[z] + (1 - q) * b0[z]) for z in (e0, -e0)] + [(mp.log(1 - q),
                                                                       (1 - q) * d0)]


def _counts(total, parts):
  """Every way of writing ``total`` as ``parts`` ordered non-negative integers."""
  if parts == 1:
    yield (total,)
    return
  for first in range(total + 1):
    for rest in _counts(total - first, parts - 1):
      yield (first,) + rest


def _composed(entries):
  """[(loss, P-mass)] of the finite composed loss, entries [(atoms, count)] (multinomials)."""
  combos = [(mp.mpf(0), mp.mpf(1))]
  for atoms, count in entries:
    atoms = [(at, p) for at, p in atoms if p > 0]
    own = []
    for ns in _counts(count, len(atoms)):
      mass, loss = mp.mpf(math.factorial(count)), mp.mpf(0)
      for n, (at, p) in zip(ns, atoms):
        mass *= p ** n / math.factorial(n)
        loss += n * at
      own.append((loss, mass))
    combos = [(l1 + l2, p1 * p2) for l1, p1 in combos for l2, p2 in own]
  return combos


def _inf_mass(*pairs):
  """P(composed loss = +inf) of steps [(P(inf) of a step, count)], exactly: 1 - prod (1 - d)^k
  (not 1 - the finite atoms' sum, which keeps 40 digits' round-off)."""
  return 1 - mp.fprod((1 - mp.mpf(d)) ** k for d, k in pairs)


def _delta_of(combos, eps, p_inf=0, tail=None):
  """Exact delta(eps): P(inf) + sum mass tail(eps - loss) (tail: the rest's curve, default
  (1 - e^x)_+ (nothing else composed))."""
  tail = tail or (lambda x: max(mp.mpf(0), -mp.expm1(x)))
  return p_inf + sum(p * tail(mp.mpf(eps) - l) for l, p in combos)


def _check_epsilon(delta_fn, eps_upper, delta, tol=0.0):
  """An epsilon upper is sound iff the true delta there is at most the asked one."""
  assert delta_fn(eps_upper) <= delta * (1 + 1e-15) + tol, (eps_upper, delta)


def kairouz_delta(e0, d0, steps, i):
  """The optimal composition theorem at eps = (k - 2i) e0: 1 - (1 - d0)^k (1 - delta_i),
  delta_i = sum_{l < i} C(k, l) (e^{(k - l) e0} - e^{(k - 2i + l) e0}) / (1 + e^{e0})^k."""
  e0, d0 = mp.mpf(e0), mp.mpf(d0)
  inner = sum(mp.binomial(steps, l) * (mp.exp((steps - l) * e0) - mp.exp((steps - 2 * i + l) * e0))
              for l in range(i)) / (1 + mp.exp(e0)) ** steps
  return 1 - (1 - d0) ** steps * (1 - inner)


def _laplace_one(x, e0):
  """One Laplace step's delta at any x: 0 from e0 on, 1 - e^{(x - e0)/2} on [-e0, e0],
  1 - e^x below (all mass above x)."""
  if x >= e0:
    return 0.0
  return -math.expm1(0.5 * (x - e0)) if x >= -e0 else -math.expm1(x)


def laplace_delta(x, e0, steps):
  """delta(x) of ``steps`` Laplace steps, by recursion over one step's loss law (atoms e0,
  mass 1/2, and -e0, e^{-e0}/2; density e^{(l - e0)/2}/4 between), quadrature to ~1e-15."""
  if steps == 1:
    return _laplace_one(x, e0)
  rest = lambda y: laplace_delta(y, e0, steps - 1)
  kinks = sorted({x - m * e0 for m in range(-steps, steps + 1) if -e0 < x - m * e0 < e0})
  inner = integrate.quad(lambda l: 0.25 * math.exp(0.5 * (l - e0)) * rest(x - l), -e0, e0,
                         points=kinks or None, epsabs=1e-16, epsrel=1e-13, limit=400)[0]
  return 0.5 * rest(x - e0) + 0.5 * math.exp(-e0) * rest(x + e0) + inner


# ----------------------------------------------------------------------------- jaxacct side

@jax.jit
def _per_direction(view, plan, eps):
  one = lambda e: jax.vmap(query._delta_direction, (0, None, None))(view, plan, e)
  return jax.vmap(one)(eps)


def _directions(pld, eps):
  """Each direction's delta Bounds (leading axis: directions) at each eps: the worse one is
  reported, but each direction's upper must bound its own truth. (The PLD is passed, not
  closed over: XLA would fold the captured arrays as constants, for minutes.)"""
  view = {key: getattr(pld, key) for key in query._VIEW}
  with jax.enable_x64(True):
    return _per_direction(view, pld.plan, jnp.asarray(eps, jnp.float64))


def _sweep(top, extra=()):
  """eps values: 0, spread below the top, just below, at and beyond it."""
  below = [top * f for f in (0.1, 0.3, 0.5, 0.7, 0.9, 0.97, 0.995)]
  near = [top - d for d in (1e-3, 1e-6, 1e-9) if top - d > 0]
  return np.array(sorted({0.0, *below, *near, top, top * (1 + 1e-15), top + 1e-9, top + 0.5,
                          *extra}))


def _check_sound(bounds, exact, tol=0.0):
  """upper >= the exact delta (less ``tol``, a reference's own error) at every point."""
  upper = np.asarray(bounds.upper, float)
  exact = np.asarray(exact, float)
  bad = upper < exact * (1.0 - 1e-15) - tol
  assert not np.any(bad), list(zip(upper[bad], exact[bad]))


# ---------------------------------------------------------------------------------- the tests

def test_one_laplace_step_is_exact_at_its_boundary():
  """The issue's acceptance: one Laplace(scale 1) step, delta(1) = 0 exactly; the upper is at
  most 1e-12 there and beyond, and above the closed form 1 - e^{(eps - 1)/2} everywhere."""
  pld = jaxacct.compose([(jaxacct.Laplace(1.0), 1)])
  eps = _sweep(1.0, extra=np.linspace(0.0, 1.2, 25))
  r = pld.delta(eps)
  exact = [_laplace_one(e, 1.0) for e in eps]
  _check_sound(r, exact)
  assert np.all(np.asarray(r.status) == 0)
  at = float(pld.delta(1.0).upper)
  assert at <= FLOOR, at
  assert np.all(np.asarray(r.upper)[eps >= 1.0] <= FLOOR)
  assert np.all(np.asarray(r.lower) <= np.asarray(exact))
  # Below the boundary the grid's upper stays tight (only the last few 1e-4 use the top).
  mid = np.abs(eps - 0.5) < 1e-12
  assert float(np.asarray(r.upper)[mid][0]) <= exact[int(np.argmax(mid))] + 1e-4


@pytest.mark.parametrize("e0, steps", [(1.0, 2), (0.3, 3), (2.5, 2)])
def test_composed_laplace_is_exact_at_the_top_and_sound_below(e0, steps):
  top = steps * e0
  pld = jaxacct.compose([(jaxacct.Laplace(1.0 / e0), steps)])
  eps = _sweep(top)
  r = pld.delta(eps)
  exact = [laplace_delta(float(e), e0, steps) for e in eps]
  _check_sound(r, exact, tol=1e-14)  # (the quadrature's own error)
  assert np.all(np.asarray(r.upper)[eps >= top] <= FLOOR)
  assert np.all(np.asarray(r.status) == 0)
  # epsilon: a pure-DP composition never gets epsilon above its top, and stays above the truth.
  for delta in (1e-3, 1e-6, 1e-10):
    upper = float(pld.epsilon(delta).upper)
    assert upper <= top
    _check_epsilon(lambda x: laplace_delta(x, e0, steps), upper, delta, tol=1e-14)


@pytest.mark.parametrize("e0, d0, steps", [(1.0, 0.0, 1), (0.7, 1e-6, 1), (0.5, 0.0, 6),
                                           (1.2, 1e-4, 4), (0.05, 1e-8, 10), (2.0, 0.0, 3)])
def test_epsilon_delta_against_the_optimal_composition(e0, d0, steps):
  """k-fold (e0, d0)-DP: the exact curve, at the lattice (k - 2i) e0 from Kairouz, Oh and
  Viswanath's formula, between by enumeration; delta(k e0) = 1 - (1 - d0)^k exactly."""
  combos = _composed([(_ed_atoms(e0, d0), steps)])
  p_inf = _inf_mass((d0, steps))
  delta_fn = lambda x: _delta_of(combos, x, p_inf)
  lattice = [(steps - 2 * i) * mp.mpf(e0) for i in range(steps // 2 + 1)]
  for i, eps in enumerate(lattice):
    assert abs(delta_fn(eps) - kairouz_delta(e0, d0, steps, i)) < 1e-35
  lattice = [float(x) for x in lattice]
  top = steps * e0
  eps = _sweep(top, extra=lattice)
  pld = jaxacct.compose([(jaxacct.EpsilonDelta(e0, d0), steps)])
  r = pld.delta(eps)
  _check_sound(r, [delta_fn(e) for e in eps])
  p_inf = float(p_inf)
  beyond = np.asarray(r.upper)[eps >= top]
  assert np.all(beyond <= p_inf * (1 + 1e-12) + FLOOR) and np.all(beyond >= p_inf)
  if steps == 1:
    assert float(pld.delta(e0).upper) == pytest.approx(d0, rel=1e-12, abs=FLOOR)
  for delta in (1e-2, 1e-5, 1e-9):
    if delta <= p_inf:
      assert math.isinf(float(pld.epsilon(delta).upper))
      continue
    upper = float(pld.epsilon(delta).upper)
    assert upper <= top
    _check_epsilon(delta_fn, upper, delta)


@pytest.mark.parametrize("noise, buckets, steps", [(0.2, 2, 1), (0.3, 10, 1), (0.5, 4, 3),
                                                   (0.05, 3, 2), (0.9, 100, 5), (1.0, 7, 2)])
def test_randomized_response_is_exact_at_its_boundary(noise, buckets, steps):
  """k-ary randomized response (the issue's second example: delta at its boundary is 0)."""
  atoms = _rr_atoms(noise, buckets)
  combos = _composed([(atoms, steps)])
  top = float(steps * atoms[0][0])
  pld = jaxacct.compose([(RandomizedResponse(noise, float(buckets)), steps)])
  eps = _sweep(top) if top > 0 else np.array([0.0, 1e-9, 0.5])
  r = pld.delta(eps)
  _check_sound(r, [_delta_of(combos, e) for e in eps])
  assert np.all(np.asarray(r.upper)[eps >= top] <= FLOOR)
  assert np.all(np.asarray(r.status) == 0)


def test_binary_randomized_response_is_pure_dp():
  """k = 2 is binary randomized response: EpsilonDelta(log((2 - p)/p)), the same curve."""
  p = 0.3
  e0 = math.log((2 - p) / p)
  eps = np.array([0.0, 0.5, 1.0, e0 - 1e-3, e0])
  rr = jaxacct.compose([(RandomizedResponse(p, 2.0), 3)]).delta(eps)
  ed = jaxacct.compose([(jaxacct.PureDP(e0), 3)]).delta(eps)
  np.testing.assert_allclose(np.asarray(rr.upper), np.asarray(ed.upper), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("base, q, steps", [("ed", 0.3, 2), ("ed0", 0.05, 3), ("ed", 0.9, 2)])
def test_subsampled_epsilon_delta_each_direction(base, q, steps):
  """Poisson-subsampled (e0, d0) steps, each direction against its own enumerated truth: the
  remove top is k f(e0); the add top is k (-log(1 - q)) where B0 has mass off B1's support (the
  -inf atom of d0 > 0), else k (-f(-e0)); at q = 1 that atom is an infinite loss instead."""
  e0, d0 = 0.8, (1e-3 if base == "ed" else 0.0)
  model = jaxacct.PoissonSampled(jaxacct.EpsilonDelta(e0, d0), q)
  pld = jaxacct.compose([(model, steps)])
  if q == 1.0:
    per_dir = [_composed([(_ed_atoms(e0, d0), steps)])] * 2
    infs = [_inf_mass((d0, steps))] * 2
  else:
    per_dir = [_composed([(_sampled_ed_atoms(e0, d0, q, add), steps)]) for add in (False, True)]
    infs = [_inf_mass((q * d0, steps)), mp.mpf(0)]  # (add: B0's -inf atom is a finite loss)
  tops = [float(max(l for l, p in c if p > 0)) for c in per_dir]
  eps = np.array(sorted({*_sweep(tops[0]), *_sweep(tops[1])}))
  r = _directions(pld, eps)
  for d, (combos, p_inf) in enumerate(zip(per_dir, infs)):
    exact = [_delta_of(combos, e, p_inf) for e in eps]
    upper = np.asarray(r.upper[:, d])
    assert np.all(upper >= np.asarray(exact, float) * (1 - 1e-15)), d
    p_inf = float(p_inf)
    assert np.all(upper[eps >= tops[d]] <= p_inf * (1 + 1e-12) + FLOOR), d


def test_heterogeneous_composition_is_exact_at_its_summed_top():
  """Laplace, (epsilon, delta) and randomized response steps on one shared grid: the top is the
  steps' sum, wherever it falls on the grid; sound below it (the Laplace part by quadrature)."""
  e_lap, steps_lap = 0.6, 2
  atoms = [(_ed_atoms(0.45, 1e-5), 3), (_rr_atoms(0.4, 6), 2)]
  combos = _composed(atoms)
  top = float(steps_lap * e_lap + max(l for l, _ in combos))
  pld = jaxacct.compose([(jaxacct.Laplace(1.0 / e_lap), steps_lap),
                         (jaxacct.EpsilonDelta(0.45, 1e-5), 3),
                         (RandomizedResponse(0.4, 6.0), 2)])
  eps = _sweep(top)
  r = pld.delta(eps)
  lap = lambda x: mp.mpf(laplace_delta(float(x), e_lap, steps_lap))
  p_inf = _inf_mass((1e-5, 3))
  _check_sound(r, [_delta_of(combos, e, p_inf, lap) for e in eps], tol=1e-14)
  p_inf = float(p_inf)
  assert np.all(np.asarray(r.upper)[eps >= top] <= p_inf * (1 + 1e-12) + FLOOR)
  # An unbounded step (a Gaussian) lifts the top: delta is positive at every eps again.
  unbounded = jaxacct.compose([(jaxacct.Laplace(1.0 / e_lap), steps_lap),
                               (jaxacct.Gaussian(3.0), 1)])
  assert float(unbounded.delta(steps_lap * e_lap + 0.5).upper) > 1e-6


def test_the_top_accumulates_over_appends():
  pld = jaxacct.compose([(jaxacct.Laplace(1.0), 1)])
  pld = pld.append([(jaxacct.PureDP(0.5), 2)])
  assert float(pld.delta(2.0).upper) <= FLOOR
  assert float(pld.delta(2.0 - 1e-3).upper) > 0.0
  grown = pld.append([(jaxacct.Gaussian(2.0), 1)])
  assert float(grown.delta(2.5).upper) > 1e-4


def test_random_sweep_of_pure_dp_compositions():
  """A seeded sweep of (e0, d0, k) and of randomized response: one plan for each family (the
  worst setting's grid), every setting's upper above its exact curve at and around its lattice,
  and exact from its top on."""
  rng = np.random.default_rng(11)
  n = 24
  e0 = rng.uniform(0.02, 2.5, n)
  d0 = np.where(rng.uniform(size=n) < 0.5, 0.0, 10.0 ** rng.uniform(-9, -2, n))
  steps = rng.integers(1, 7, n)
  noise = rng.uniform(0.05, 0.95, n)
  buckets = rng.integers(2, 21, n).astype(float)
  families = [
      ([jaxacct.EpsilonDelta(a, b) for a, b in zip(e0, d0)], [_ed_atoms(a, b) for a, b in
                                                               zip(e0, d0)]),
      ([RandomizedResponse(a, b) for a, b in zip(noise, buckets)], [_rr_atoms(a, b) for a, b in
                                                                    zip(noise, buckets)])]
  infs = [[_inf_mass((d, 1)) for d in d0], [0] * n]
  for (models, atom_sets), inf_masses in zip(families, infs):
    batched = jax.tree_util.tree_map(lambda *v: np.array(v), *models)
    plan = jaxacct.make_plan(jaxacct.Composition.of((batched, steps.astype(float))), 1e-10)
    for model, atoms, k, inf in zip(models, atom_sets, steps, inf_masses):
      combos = _composed([(atoms, int(k))])
      p_inf = 1 - (1 - mp.mpf(inf)) ** int(k)
      top = float(max(l for l, p in combos if p > 0))
      lattice = sorted({float(l) for l, _ in combos})
      eps = np.array(sorted({*_sweep(top), *[x for x in lattice if x >= 0],
                             *rng.uniform(0, top + 0.1, 6)}))
      r = jaxacct.compose([(model, int(k))], plan=plan).delta(eps)
      _check_sound(r, [_delta_of(combos, e, p_inf) for e in eps])
      p_inf = float(p_inf)
      assert np.all(np.asarray(r.upper)[eps >= top] <= p_inf * (1 + 1e-12) + FLOOR)
      assert np.all(np.asarray(r.status) == 0)


def test_the_support_bound_is_an_upper_bound_of_delta_and_inverts():
  """``_support_delta`` against its definition, and ``_support_epsilon`` as its inverse: the
  delta at the returned eps is at most the asked one."""
  with jax.enable_x64(True):
    for log_finite, top, count in [(0.0, 1.0, 1.0), (-1e-6, 3.0, 3.0), (-0.2, 25.0, 10.0)]:
      view = dict(log_finite=jnp.asarray(log_finite), loss_top=jnp.asarray(top),
                  total_count=jnp.asarray(count))
      p = -math.expm1(log_finite)
      for eps in (0.0, top - 1.0, top - 1e-9, top, top + 1.0):
        exact = p + (1 - p) * max(0.0, -math.expm1(eps - top))
        assert float(query._support_delta(view, jnp.asarray(eps))) >= exact
      for delta in (p + 1e-12, p + 1e-6, 0.5 * (1 + p), 0.99):
        if delta >= 1.0:
          continue
        at = query._support_epsilon(view, jnp.asarray(delta))
        assert float(query._support_delta(view, at)) <= delta
      if p > 0:  # (delta at or below P(inf): no epsilon serves it)
        assert math.isinf(float(query._support_epsilon(view, jnp.asarray(p))))


def test_max_loss_is_the_top_of_each_model():
  """Each model's max_loss: no finite P-mass above it (sf = P(inf)), some just below (tight), in
  each direction; +inf for unbounded losses."""
  models = [jaxacct.Laplace(0.7), jaxacct.Laplace(2.0, 3.0), jaxacct.EpsilonDelta(1.3, 1e-3),
            jaxacct.PureDP(0.0), RandomizedResponse(0.25, 5.0), RandomizedResponse(1.0, 3.0),
            jaxacct.PoissonSampled(jaxacct.Laplace(1.0), 0.2),
            jaxacct.PoissonSampled(jaxacct.EpsilonDelta(1.0, 1e-3), 0.3),
            jaxacct.PoissonSampled(jaxacct.EpsilonDelta(1.0, 0.0), 0.3),
            jaxacct.PoissonSampled(jaxacct.Gaussian(1.0), 0.5)]
  with jax.enable_x64(True):
    for model in models:
      unbounded_remove = isinstance(getattr(model, "base", None), jaxacct.Gaussian)
      for add in (True,) if unbounded_remove else (False, True):
        top = float(model.max_loss(add))
        inf_mass = float(model.inf_mass(add))
        above = float(model.cdf_sf(jnp.asarray([top]), add)[1][0]) - inf_mass
        below = float(model.cdf_sf(jnp.asarray([top - 1e-3]), add)[1][0]) - inf_mass
        assert math.isfinite(top), (model, add)
        assert abs(above) <= 1e-15 and (below > 0 or top == 0.0), (model, add, above, below)
    assert math.isinf(float(jaxacct.Gaussian(1.0).max_loss()))
    assert math.isinf(float(jaxacct.PoissonSampled(jaxacct.Gaussian(1.0), 0.5).max_loss(False)))
    assert math.isinf(float(jaxacct.SampledGaussianReplaceOne(1.0, 0.1).max_loss()))


def test_gradient_of_the_top_bound():
  """Where the top decides epsilon (pure DP, small delta) its gradient is the top's: for
  Laplace steps d eps / d scale = -k sensitivity / scale^2."""
  comp = jaxacct.Composition.of((jaxacct.Laplace(1.0), 2))
  plan = jaxacct.make_plan(comp, 1e-10)
  upper = lambda s: jaxacct.pld.epsilon([(jaxacct.Laplace(s), 2)], 1e-8, plan=plan).upper
  with jax.enable_x64(True):
    g = float(jax.jit(jax.grad(upper))(jnp.asarray(1.0)))  # (compiled: op by op it takes 30 s)
  assert g == pytest.approx(-2.0, rel=1e-9)
