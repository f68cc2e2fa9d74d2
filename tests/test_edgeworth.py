"""The Edgeworth accountant against closed forms, the digest's reference values (seed_003.md:
cumulants by adaptive quadrature, AEA values, PLD truths, the error bound's published test
vectors) and the stored dp-accounting / prv-accountant references."""

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxacct
from jaxacct import cgf, edgeworth, models, results
from jaxacct.composition import Composition

from conftest import gaussian_delta, pure_dp_delta
from conftest import subsampled_gaussian as _sgd

REFERENCES = pathlib.Path(__file__).parent / "data" / "references.json"


@pytest.fixture(autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


def test_error_bound_matches_published_vectors():
  """BoundEdgeworth's documented values (seed_003.md section 2.8): n = 1000, K4 = 9."""
  k4, n = 9.0, 1000.0
  k3 = k4 ** 0.75
  lam3 = 0.621 * k3
  assert float(edgeworth._derumigny_iid(n, k3, k3 + 1, k4, lam3)) == pytest.approx(
      0.1626857, abs=1e-7)
  assert float(edgeworth._derumigny_inid(n, k3, 2 * k3, k4, lam3)) == pytest.approx(
      0.146259, abs=1e-6)
  # Outside its validity condition n >= K4 / (1 - 4 chi_1)^2 the bound does not apply.
  assert math.isinf(float(edgeworth._derumigny_inid(20.0, k3, 2 * k3, k4, lam3)))


# seed_003.md section 3: per-step cumulants of X (the loss under Q) and Y (under P).
CUMULANTS = [
    ((0.01, 0.8), (-1.671653048184e-04, 3.171046803149e-04, 4.707668361681e-05,
                   1.619816751375e-05, 9.466433686391e-06),
     (1.766525368156e-04, 3.742797721826e-04, 6.981175061292e-05, 3.172821603365e-05,
      2.465409656065e-05)),
    ((0.05, 1.0), (-1.789066241508e-03, 3.302994511414e-03, 7.375947076890e-04,
                   3.070995183971e-04, 1.903611914395e-04),
     (1.943410617092e-03, 4.234037889157e-03, 1.174628160082e-03, 6.130647431423e-04,
      4.737871675130e-04)),
    ((0.0005, 1.0), (-2.142099202238e-07, 4.278478540297e-07, 1.711100024711e-09,
                     1.933026375955e-11, 5.278852819693e-13),
     (2.144967277944e-07, 4.295687085240e-07, 1.730699692262e-09, 1.987470391199e-11,
      5.616959801216e-13)),
    ((0.1, 0.8), (-1.085316054566e-02, 1.763220267239e-02, 9.464454891518e-03,
                  8.367647988893e-03, 1.003220868517e-02),
     (1.349718834708e-02, 3.388715393826e-02, 2.704596262996e-02, 3.369485485254e-02,
      5.435282678061e-02)),
]


@pytest.mark.parametrize("params,under_q,under_p", CUMULANTS)
def test_cumulants_match_adaptive_quadrature(params, under_q, under_p):
  q, sigma = params
  model = models.PoissonSampled(models.Gaussian(sigma), q)
  np.testing.assert_allclose(cgf.law_moments(model, -1.0)[:5], under_q, rtol=1e-9)
  np.testing.assert_allclose(cgf.law_moments(model, 0.0)[:5], under_p, rtol=1e-9)
  # The add direction is the mirror image: X2 = -Y1 and Y2 = -X1.
  flip = (-1.0) ** np.arange(1, 6)
  np.testing.assert_allclose(cgf.law_moments(model, -1.0, True)[:5], flip * under_p, rtol=1e-9)
  np.testing.assert_allclose(cgf.law_moments(model, 0.0, True)[:5], flip * under_q, rtol=1e-9)


# seed_003.md section 3: E|d| and E|d|^3 (adaptive quadrature split at the kink).
ABSOLUTE = [((0.01, 0.8), (9.150804906e-3, 4.759834303e-5), (9.584270946e-3, 7.040081234e-5)),
            ((0.05, 1.0), (3.649720368e-2, 7.801025566e-4), (4.028391579e-2, 1.229912546e-3))]


@pytest.mark.parametrize("params,under_q,under_p", ABSOLUTE)
def test_absolute_moments_within_their_slack(params, under_q, under_p):
  """The error bound reads E|d| inflated by its slack: it must not fall below the truth."""
  q, sigma = params
  model = models.PoissonSampled(models.Gaussian(sigma), q)
  for t, (abs1, abs3) in ((-1.0, under_q), (0.0, under_p)):
    m = np.asarray(cgf.law_moments(model, t))
    assert m[5] * (1 + edgeworth._ABS1_SLACK) >= abs1
    assert m[5] == pytest.approx(abs1, rel=edgeworth._ABS1_SLACK)
    assert m[6] * (1 + edgeworth._ABS34_SLACK) >= abs3 * (1 - 1e-9)


# seed_003.md section 5.2, delta at fixed eps: (q, sigma, m, eps, AEA2, PLD truth).
DELTAS = [(0.01, 0.8, 1000, 1.0, 2.331328e-2, 2.416775e-2),
          (0.01, 0.8, 2000, 1.5, 3.046952e-2, 3.091634e-2),
          (0.05, 1.0, 200, 4.0, 2.575702e-4, 9.980028e-5),
          (0.0005, 1.0, 20000, 0.3, 2.367187e-5, 2.331459e-5),
          (0.004, 0.8, 10000, 0.7, 1.036697e-1, 1.038051e-1)]


@pytest.mark.parametrize("q,sigma,m,eps,aea2,truth", DELTAS)
def test_delta_reproduces_digest(q, sigma, m, eps, aea2, truth):
  out = jaxacct.delta(_sgd(q, sigma, m), eps, accountant="edgeworth")
  assert float(out.estimate) == pytest.approx(aea2, rel=1e-6)
  assert float(out.upper) >= truth
  assert math.isnan(float(out.lower)) or float(out.lower) <= truth


def test_first_order_tails_are_clipped():
  """At q = 0.05, sigma = 1, m = 200, eps = 4 the unclipped first-order series of the add
  direction has negative tails (the digest's AEA1 2.1189e-4 comes from them); clipped to [0, 1],
  the first-order estimate is the remove direction's 1.5604e-4."""
  out = jaxacct.delta(_sgd(0.05, 1.0, 200), 4.0, accountant="edgeworth", method="order1")
  assert float(out.estimate) == pytest.approx(1.5604264e-4, rel=1e-6)


@pytest.mark.parametrize("sigma,m,eps,exact", [(1.0, 10, 2.0, 7.293863295575e-01),
                                               (2.0, 100, 3.0, 9.518486101179e-01)])
def test_exact_for_gaussian_steps(sigma, m, eps, exact):
  """Without subsampling every cumulant above the second vanishes: the series is the exact
  Gaussian curve (seed_003.md section 5.2), at every order."""
  comp = Composition.of((models.Gaussian(sigma), m))
  for method in edgeworth.METHODS if m == 10 else ("order2",):
    out = jaxacct.delta(comp, eps, accountant="edgeworth", method=method)
    assert float(out.estimate) == pytest.approx(exact, rel=1e-12)
    assert float(out.estimate) == pytest.approx(gaussian_delta(eps, math.sqrt(m) / sigma),
                                                rel=1e-12)


# seed_003.md section 5.2, eps(delta): (q, sigma, delta, m, AEA1, AEA2, AEA3), 4 decimals. None:
# the digest's value comes from the add direction's unclipped, negative tail approximations
# (which push delta up); with the tails clipped to [0, 1] that root does not exist.
EPSILONS = [(0.01, 0.8, 0.015, 100, 0.2185, 0.2102, 0.2201),
            (0.01, 0.8, 0.015, 1000, 1.2287, 1.1482, 1.1531),
            (0.01, 0.8, 0.015, 2000, 1.9129, 1.8234, 1.8223),
            (0.05, 1.0, 1e-5, 20, None, 1.6085, None),
            (0.05, 1.0, 1e-5, 200, None, 4.8937, None)]


@pytest.mark.parametrize("q,sigma,delta,m,aea1,aea2,aea3", EPSILONS)
def test_epsilon_reproduces_digest(q, sigma, delta, m, aea1, aea2, aea3):
  for method, want in (("order1", aea1), ("order2", aea2), ("order3", aea3)):
    if want is None:
      continue
    out = jaxacct.epsilon(_sgd(q, sigma, m), delta, accountant="edgeworth", method=method)
    assert float(out.estimate) == pytest.approx(want, abs=6e-5)


def test_largest_root_and_flag_where_the_series_breaks_down():
  """m = 20, q = 0.01, sigma = 0.8: the series is non-monotone with roots 0.0111, 0.2170, 0.3057
  (seed_003.md section 6); the accountant returns the largest and flags the regime."""
  out = jaxacct.epsilon(_sgd(0.01, 0.8, 20), 0.015, accountant="edgeworth")
  assert float(out.estimate) == pytest.approx(0.3057, abs=6e-5)
  assert int(out.status) & results.UNRELIABLE
  assert int(out.status) & results.UPPER_VACUOUS and math.isinf(float(out.upper))


# seed_003.md section 5.2, Fig. 3 regimes (sigma = 0.8, delta = 0.1): (m, q, PLD truth, the
# digest's EEAI upper with the uniform i.n.i.d. bound alone).
FIG3 = [(1e5, 1.265e-3, 0.7259, 1.455), (1e6, 4.000e-4, 0.7293, 0.820),
        (1e5, 9.320e-4, 0.3899, 1.025), (1e6, 2.690e-4, 0.3200, 0.370),
        (1e6, 3.717e-4, 0.6331, 0.710)]


@pytest.mark.parametrize("m,q,truth,digest_upper", FIG3)
def test_certified_interval_is_finite_and_valid_at_large_m(m, q, truth, digest_upper):
  out = jaxacct.epsilon(_sgd(q, 0.8, m), 0.1, accountant="edgeworth")
  lower, upper = float(out.lower), float(out.upper)
  assert 0.0 < lower <= truth <= upper <= digest_upper + 5e-3
  assert not int(out.status) & (results.UPPER_VACUOUS | results.LOWER_VACUOUS)


@pytest.mark.parametrize("mu_step,m,delta", [(0.05, 20000, 0.1), (0.02, 100000, 0.05),
                                             (0.3, 5000, 0.2)])
def test_certified_interval_brackets_composed_gaussians(mu_step, m, delta):
  comp = Composition.of((models.Gaussian(1.0 / mu_step), m))
  from conftest import gaussian_epsilon
  exact = gaussian_epsilon(delta, mu_step * math.sqrt(m))
  out = jaxacct.epsilon(comp, delta, accountant="edgeworth")
  assert float(out.lower) <= exact <= float(out.upper) < math.inf
  assert float(out.estimate) == pytest.approx(exact, rel=1e-9)
  for eps in (0.5 * exact, exact, 1.5 * exact):
    d = jaxacct.delta(comp, eps, accountant="edgeworth")
    truth = gaussian_delta(eps, mu_step * math.sqrt(m))
    assert float(d.upper) >= truth and not float(d.lower) > truth


@pytest.mark.parametrize("eps0,k,eps", [(0.05, 4000, 2.0), (0.02, 20000, 1.5)])
def test_bounds_hold_for_randomized_response(eps0, k, eps):
  """A lattice loss (two atoms): the series is off by the lattice error, the bounds still hold."""
  comp = Composition.of((models.PureDP(eps0), k))
  truth = pure_dp_delta(eps, eps0, k)
  out = jaxacct.delta(comp, eps, accountant="edgeworth")
  assert float(out.upper) >= truth
  assert math.isnan(float(out.lower)) or float(out.lower) <= truth


def _stored():
  for row in json.loads(REFERENCES.read_text()):
    comps = [jaxacct.dpsgd_composition(s, q, n, row["relation"]) for s, q, n in row["entries"]]
    comp = comps[0]
    for extra in comps[1:]:
      comp = comp.append(extra)
    tol = abs(row["dpa_2e5"] - row["dpa_1e5"]) + 1e-9 * max(1.0, row["reference"])
    yield comp, row["delta"], row["reference"], tol


def test_stored_references_bounds_and_reliable_estimates():
  """Every finite bound brackets the stored truth (dp-accounting's fine PLD, inside
  prv-accountant's bracket); unflagged estimates are within 1e-3 relative."""
  unflagged = 0
  for comp, delta, truth, tol in _stored():
    out = jaxacct.epsilon(comp, delta, accountant="edgeworth")
    assert not float(out.lower) > truth + tol
    assert not float(out.upper) < truth - tol
    if not int(out.status) & results.UNRELIABLE:
      unflagged += 1
      assert abs(float(out.estimate) - truth) <= 1e-3 * max(1.0, truth)
  assert unflagged >= 15


def test_heterogeneous_lists_add_cumulants():
  one = _sgd(0.01, 1.0, 3000)
  split = Composition.of((models.PoissonSampled(models.Gaussian(1.0), 0.01), 1000),
                         (models.PoissonSampled(models.Gaussian(1.0), 0.01), 2000))
  a = jaxacct.epsilon(one, 1e-5, accountant="edgeworth")
  b = jaxacct.epsilon(split, 1e-5, accountant="edgeworth")
  assert float(b.estimate) == pytest.approx(float(a.estimate), rel=1e-12)
  # The split list uses the non-identical error bound only: never tighter.
  assert not float(b.lower) > float(a.lower)


def test_jit_vmap_and_grad():
  f = lambda s, q=0.01, m=1000.0: edgeworth.epsilon(_sgd(q, s, m), 0.015).estimate
  f_jit = jax.jit(f)
  # seed_003.md section 5.2: central differences of the float64 reference at sigma = 0.8.
  grad = jax.jit(jax.grad(f, argnums=(0, 1, 2)))
  np.testing.assert_allclose(grad(0.8, 0.01, 1000.0), [-3.92399, 155.92, 7.7178e-4], rtol=2e-5)
  g = jax.jit(lambda s, e: edgeworth.delta(_sgd(0.01, s, 1000.0), e).estimate)
  assert float(g(0.8, 1.0)) == pytest.approx(2.3313279733e-2, rel=1e-9)
  np.testing.assert_allclose(jax.jit(jax.grad(g, argnums=(0, 1)))(0.8, 1.0),
                             [-0.238468, -0.0682219], rtol=1e-5)
  sigmas = jnp.linspace(0.9, 3.0, 5)
  looped = np.array([float(f_jit(s)) for s in sigmas])
  np.testing.assert_allclose(jax.jit(jax.vmap(f))(sigmas), looped, rtol=1e-12)
  batched = jaxacct.dpsgd_epsilon(np.asarray(sigmas), 0.01, 1000, 0.015, accountant="edgeworth")
  np.testing.assert_allclose(batched.estimate, looped, rtol=1e-12)
  for s, q in ((1.3, 0.003), (2.1, 0.05)):
    h = 1e-5 * s
    fd = (float(f_jit(s + h, q)) - float(f_jit(s - h, q))) / (2 * h)
    assert float(grad(s, q, 1000.0)[0]) == pytest.approx(fd, rel=1e-4)


def test_bad_input():
  comp = _sgd(0.01, 1.0, 1000)
  with pytest.raises(ValueError, match="method"):
    jaxacct.epsilon(comp, 1e-5, accountant="edgeworth", method="order9")
  with pytest.raises(ValueError, match="infinite cumulant"):
    jaxacct.epsilon(Composition.of((models.EpsilonDelta(1.0, 1e-6), 3)), 1e-5,
                    accountant="edgeworth")
  with pytest.raises(ValueError, match="delta"):
    jaxacct.epsilon(comp, 0.0, accountant="edgeworth")
  with pytest.raises(ValueError, match="epsilon"):
    jaxacct.delta(comp, -1.0, accountant="edgeworth")
