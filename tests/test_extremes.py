"""Extreme settings (tiny q, large sigma, T = 1e6, delta 1e-10 and 1e-12) against dp-accounting,
and bounded losses at extreme parameters (exact delta from their top on).

dp-accounting's pessimistic PLD certifies an upper bound of the truth, its optimistic one a lower
bound; our bracket must be consistent with both, and every one of these settings must be
certified (status 0, finite bounds). (A delta below the numerical floor, where the upper is +inf
with the BELOW_FLOOR status, is tested in test_inputs.py.)
"""

import logging
import math

import numpy as np
import pytest

import jaxacct
from jaxacct import results
from jaxacct.models import RandomizedResponse
from dp_accounting.pld import privacy_loss_distribution as dpa_pld

logging.getLogger().setLevel(logging.ERROR)

CASES = [  # sigma, q, T, delta, dp-accounting grid step
    (1.0, 1e-5, 100_000, 1e-10, 1e-6),
    (10.0, 1e-4, 1_000, 1e-6, 1e-7),
    (50.0, 0.5, 10_000, 1e-8, 1e-5),
    (1.0, 1e-3, 1_000_000, 1e-5, 2e-5),
    (0.6, 0.02, 2_000, 1e-10, 1e-4),
    (2.0, 0.01, 5_000, 1e-12, 1e-4),
]


def _dpa(sigma, rate, steps, delta, step, pessimistic):
  mech = dpa_pld.from_gaussian_mechanism(standard_deviation=sigma, sampling_prob=rate,
                                         value_discretization_interval=step,
                                         pessimistic_estimate=pessimistic,
                                         use_connect_dots=pessimistic)
  return mech.self_compose(steps).get_epsilon_for_delta(delta)


@pytest.mark.slow
@pytest.mark.parametrize("sigma, rate, steps, delta, step", CASES)
def test_extreme_settings(sigma, rate, steps, delta, step):
  r = jaxacct.dpsgd_epsilon(sigma, rate, steps, delta)
  upper_ref = _dpa(sigma, rate, steps, delta, step, True)
  lower_ref = _dpa(sigma, rate, steps, delta, step, False)
  lower, estimate, upper = float(r.lower), float(r.estimate), float(r.upper)
  # Every one of these settings lies above the numerical floor: certified, finite bounds.
  assert int(r.status) == 0
  assert math.isfinite(lower) and math.isfinite(upper)
  assert lower <= upper_ref
  assert lower <= estimate <= upper
  assert upper >= lower_ref
  assert abs(estimate - upper_ref) <= 1e-3 * max(1.0, upper_ref)


@pytest.mark.parametrize("accountant", ["pld", "spa", "edgeworth", "rdp", "gdp"])
@pytest.mark.parametrize("composition,eps", [
    (jaxacct.Composition.of((jaxacct.Gaussian(1.0), 1)), 40.0),
    (jaxacct.Composition.of((jaxacct.Gaussian(1.0), 1)), 2000.0),
    # The saddle point lies beyond the tilt grid (an upper bound from t = t_max).
    (jaxacct.Composition.of((jaxacct.PoissonSampled(jaxacct.Gaussian(9.43), 0.000586), 556)), 24.9),
])
def test_upper_delta_never_underflows_to_zero(accountant, composition, eps):
  """The true delta is positive however large eps is; an upper bound below float64's range is
  reported as the smallest normal number with the UPPER_FLOORED status, never 0 (nor nan). The
  one exception is GDP on subsampled steps: a central-limit estimate that certifies nothing
  (upper nan, status APPROXIMATION)."""
  r = jaxacct.delta(composition, eps, accountant=accountant)
  upper, status = float(r.upper), int(r.status)
  tiny = np.finfo(np.float64).tiny
  if accountant == "gdp" and isinstance(composition.mechanisms[0], jaxacct.PoissonSampled):
    assert math.isnan(upper) and status & results.APPROXIMATION, (upper, status)
    return
  assert math.isfinite(upper) and tiny <= upper <= 1.0, (upper, status)
  if upper == tiny:
    assert status & results.UPPER_FLOORED, (upper, status)


@pytest.mark.parametrize("accountant", ["pld", "spa", "edgeworth", "rdp", "gdp"])
def test_upper_delta_at_huge_eps_is_no_larger_than_at_a_smaller_eps(accountant):
  """The true delta is non-increasing in eps, so upper(40) bounds delta(2000) too: at eps = 2000
  (e^eps overflows float64) the upper must still be a number, and no larger."""
  comp = jaxacct.Composition.of((jaxacct.Gaussian(1.0), 1))
  at_40 = float(jaxacct.delta(comp, 40.0, accountant=accountant).upper)
  at_2000 = float(jaxacct.delta(comp, 2000.0, accountant=accountant).upper)
  assert math.isfinite(at_2000) and at_2000 <= at_40, (at_2000, at_40)


def _lap(e0, x):
  """One Laplace step's exact delta (e0 = sensitivity / scale)."""
  return 0.0 if x >= e0 else -math.expm1(0.5 * (x - e0))


# composition, its top (the summed largest losses), P(L = inf), [(eps, exact delta)].
BOUNDED = [
    ([(jaxacct.Laplace(0.05), 1)], 20.0, 0.0, [(19.0, _lap(20.0, 19.0)), (5.0, _lap(20.0, 5.0))]),
    ([(jaxacct.Laplace(1e6), 1)], 1e-6, 0.0, [(0.0, _lap(1e-6, 0.0))]),
    ([(jaxacct.EpsilonDelta(0.0, 0.3), 5)], 0.0, -math.expm1(5 * math.log1p(-0.3)), []),
    ([(jaxacct.EpsilonDelta(2.0, 0.999), 2)], 4.0, -math.expm1(2 * math.log1p(-0.999)), []),
    ([(RandomizedResponse(1e-6, 2.0), 1)], math.log1p(2 * (1 - 1e-6) / 1e-6), 0.0,
     [(13.0, (1 - 0.5e-6) * -math.expm1(13.0 - math.log1p(2 * (1 - 1e-6) / 1e-6)))]),
    ([(RandomizedResponse(1.0, 9.0), 3)], 0.0, 0.0, []),
    ([(jaxacct.Gaussian(1.0), 0), (jaxacct.Laplace(1.0), 1)], 1.0, 0.0, [(0.5, _lap(1.0, 0.5))]),
    ([(jaxacct.PureDP(0.01), 5000)], 50.0, 0.0, []),
]


@pytest.mark.parametrize("entries, top, p_inf, points", BOUNDED, ids=range(len(BOUNDED)))
def test_bounded_losses_are_exact_at_their_top(entries, top, p_inf, points):
  """Huge and tiny Laplace steps, (0, delta) and near-1 delta, randomized response near
  non-privacy and at p = 1 (nothing released), an unbounded entry of count 0, and a top far
  beyond the composed window: delta is P(inf) from the top on (to 1e-12), certified below it."""
  eps = np.array([top, top + 1e-9, top + 3.0] + [e for e, _ in points])
  r = jaxacct.delta(entries, eps)
  upper = np.asarray(r.upper)
  assert np.all(upper[:3] >= p_inf) and np.all(upper[:3] <= p_inf * (1 + 1e-12) + 1e-12), upper
  for got, (_, exact) in zip(upper[3:], points):
    assert got >= exact, (got, exact)
