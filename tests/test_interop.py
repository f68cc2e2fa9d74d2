"""jaxacct where dp-accounting and jax_privacy expect their own accountants: the
``JaxacctAccountant`` answers jaxacct's certified upper bounds for dp-accounting's event trees
(its published test cases included), ``JaxacctAccountantConfig`` runs jax_privacy's calibration,
and ``to_dp_event`` writes the tree a dp-accounting user would have written."""

import math

import jax
import numpy as np
import pytest

import jaxacct
from conftest import gaussian_delta, gaussian_epsilon

dp_accounting = pytest.importorskip("dp_accounting")
from dp_accounting import dp_event as ev  # noqa: E402
from dp_accounting.pld import pld_privacy_accountant  # noqa: E402

from jaxacct.interop import JaxacctAccountant  # noqa: E402

G, L, P = ev.GaussianDpEvent, ev.LaplaceDpEvent, ev.PoissonSampledDpEvent
S, C, RR = ev.SelfComposedDpEvent, ev.ComposedDpEvent, ev.RandomizedResponseDpEvent
MOG = ev.MixtureOfGaussiansDpEvent
ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE
# The adapter's stated tolerance: its epsilon is the PLD accountant's certified upper, at most
# 2 eps_error (0.02 by default) above the truth; never below it.
TOLERANCE = 0.02


def _dp_accounting_pld(event, delta, relation=ADD_REMOVE):
  accountant = pld_privacy_accountant.PLDAccountant(relation, value_discretization_interval=1e-4)
  return accountant.compose(event).get_epsilon(delta)


def test_dpsgd_answers_jaxaccts_certified_upper():
  accountant = JaxacctAccountant()
  assert accountant.compose(P(0.01, G(1.0)), 300) is accountant
  epsilon = accountant.get_epsilon(1e-5)
  bounds = accountant.epsilon_bounds(1e-5)
  assert epsilon == float(jaxacct.dpsgd_epsilon(1.0, 0.01, 300, 1e-5).upper)
  theirs = _dp_accounting_pld(S(P(0.01, G(1.0)), 300), 1e-5)
  assert float(bounds.lower) <= theirs <= epsilon + 1e-4  # (theirs: pessimistic, on a 1e-4 grid)
  assert epsilon - theirs <= TOLERANCE
  assert accountant.get_delta(epsilon) <= 1e-5 * (1 + 1e-3)


def test_composes_incrementally():
  """compose, query, compose more, query: the same answer as composing it all at once, the
  repeated event counted in one entry."""
  grown = JaxacctAccountant()
  grown.compose(P(0.02, G(0.9)), 300)
  first = grown.get_epsilon(1e-6)
  grown.compose(S(P(0.02, G(0.9)), 100), 2).compose(G(8.0))
  at_once = JaxacctAccountant().compose(C([S(P(0.02, G(0.9)), 500), G(8.0)]))
  assert grown.get_epsilon(1e-6) == at_once.get_epsilon(1e-6) > first
  assert [int(c) for c in grown.composition().counts] == [500, 1]
  assert grown.ledger == C([S(P(0.02, G(0.9)), 500), G(8.0)])  # (dp-accounting's own ledger)


@pytest.mark.parametrize("sigma, steps", [(4.0, 10), (30.0, 500)])
def test_replace_one_is_honoured(sigma, steps):
  """REPLACE_ONE Gaussians shift by twice the sensitivity: mu = 2 sqrt(k) / sigma, exactly."""
  exact = gaussian_epsilon(1e-6, 2.0 * math.sqrt(steps) / sigma)
  accountant = JaxacctAccountant(REPLACE_ONE).compose(G(sigma), steps)
  epsilon = accountant.get_epsilon(1e-6)
  assert exact <= epsilon <= exact + TOLERANCE
  assert JaxacctAccountant().compose(G(sigma), steps).get_epsilon(1e-6) < exact


# (event, relation) pairs across what dp-accounting's own accountants accept and refuse.
EVENTS = [
    (G(1.0), ADD_REMOVE), (S(P(0.1, L(2.0)), 3), ADD_REMOVE), (RR(0.2, 4), ADD_REMOVE),
    (RR(0.2, 4), REPLACE_ONE), (L(1.0), REPLACE_ONE), (P(0.1, L(1.0)), REPLACE_ONE),
    (MOG(1.0, [0.0, 1.0], [0.5, 0.5]), REPLACE_ONE), (P(0.1, S(G(1.0), 2)), ADD_REMOVE),
    (ev.ZCDpEvent(0.5), ADD_REMOVE), (ev.UnsupportedDpEvent(), ADD_REMOVE),
    (ev.DiscreteLaplaceDpEvent(1.0, 1), ADD_REMOVE),
    (ev.TruncatedSubsampledGaussianDpEvent(1000, 0.01, 20, 1.0), ADD_REMOVE),
    (ev.SampledWithoutReplacementDpEvent(100, 10, G(1.0)), ADD_REMOVE),
    (C([S(P(0.02, G(0.9)), 30), ev.UnsupportedDpEvent()]), ADD_REMOVE),
    (C([S(P(0.02, G(0.9)), 30), RR(0.5, 3)]), REPLACE_ONE),
    (G(0.0), ADD_REMOVE), (ev.NonPrivateDpEvent(), REPLACE_ONE),
]


def _translates(event, relation):
  name = "add_remove" if relation == ADD_REMOVE else "replace_one"
  try:
    jaxacct.from_dp_event(event, relation=name)
  except ValueError as err:
    return "no privacy" in str(err)  # (steps without noise: the accountant answers inf)
  return True


@pytest.mark.parametrize("event, relation", EVENTS, ids=range(len(EVENTS)))
def test_supports_exactly_what_from_dp_event_translates(event, relation):
  accountant = JaxacctAccountant(relation)
  expected = _translates(event, relation)
  assert accountant.supports(event) == expected
  if not expected:
    with pytest.raises(dp_accounting.UnsupportedEventError, match="jaxacct cannot express"):
      accountant.compose(event)
    assert accountant.get_epsilon(1e-5) == 0.0  # (nothing was composed)


def test_bad_options_are_refused():
  with pytest.raises(ValueError, match="gdp"):
    JaxacctAccountant(accountant="gdp")
  with pytest.raises(ValueError, match="eps_error"):
    JaxacctAccountant(accountant="rdp", eps_error=0.1)
  with pytest.raises(ValueError, match="REPLACE_SPECIAL"):
    JaxacctAccountant(dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
  with pytest.raises(ValueError):
    JaxacctAccountant().compose(G(1.0), 0)  # (dp-accounting: counts are >= 1)


# dp-accounting's published PLD accountant cases (values from its test suite, written anew):
# (events composed in turn, relation, "epsilon" at delta or "delta" at epsilon, target,
#  the published value, whether that value is exact (a closed form) or dp-accounting's own).
def _pure_laplace():  # 3 x Laplace(1) + 2 x Laplace(2): pure epsilon 3 + 1
  return [(L(1.0), 3), (L(2.0), 2)]


PUBLISHED = [
    ("gaussian", [(G(math.sqrt(3.0)), 1), (G(math.sqrt(3.0)), 2)], ADD_REMOVE, "delta", 1.0,
     gaussian_delta(1.0, 1.0), True),
    ("gaussian", [(G(math.sqrt(3.0)), 1), (G(math.sqrt(3.0)), 2)], ADD_REMOVE, "epsilon",
     gaussian_delta(1.0, 1.0), 1.0, True),
    ("subsampled gaussian", [(P(0.2, G(0.5)), 1), (P(0.2, G(0.5)), 2)], ADD_REMOVE, "delta", 1.0,
     0.15594, False),
    ("self-composed", [(S(P(0.2, G(0.5)), 3), 1)], ADD_REMOVE, "epsilon", 0.15594, 1.0, False),
    ("laplace", _pure_laplace(), ADD_REMOVE, "epsilon", 1e-14, 4.0, True),
    ("laplace", _pure_laplace(), ADD_REMOVE, "delta", 4.0, 0.0, True),
    ("subsampled laplace", [(P(0.2, L(0.5)), 1), (P(0.2, L(0.5)), 2)], ADD_REMOVE, "epsilon",
     1e-14, 3 * math.log1p(0.2 * math.expm1(2.0)), True),
    ("mixture", [(MOG(1.0, [0.0, 1.0, 2.0], [0.2, 0.6, 0.2]), 3),
                 (MOG(2.0, [0.0, 2.0, 3.0], [0.33, 0.34, 0.33]), 2)], ADD_REMOVE, "epsilon",
     1e-6, 17.193115, False),
    ("randomized response", [(RR(4.0 / (3.0 + math.e), 4), 1)], REPLACE_ONE, "delta", 1.0, 0.0,
     True),
]


@pytest.mark.parametrize("name, events, relation, kind, target, value, exact", PUBLISHED,
                         ids=[f"{case[0]}-{case[3]}" for case in PUBLISHED])
def test_dp_accountings_published_pld_cases(name, events, relation, kind, target, value, exact):
  accountant = JaxacctAccountant(relation)
  for event, count in events:
    accountant.compose(event, count)
  if kind == "epsilon":
    answer, bounds = accountant.get_epsilon(target), accountant.epsilon_bounds(target)
    assert answer - value <= TOLERANCE, (name, answer, value)
    # An exact value is never above the certified upper; dp-accounting's own (pessimistic)
    # values lie in the certified bracket up to its 1e-4 grid.
    assert (value <= answer + 1e-12) if exact else (float(bounds.lower) <= value + 1e-4)
  else:
    answer, bounds = accountant.get_delta(target), accountant.delta_bounds(target)
    assert value * (1 - 1e-9) <= answer if exact else float(bounds.lower) <= value
    assert answer <= value * (1 + 2e-2) + 1e-12, (name, answer, value)


@pytest.mark.parametrize("event", [G(0.0), L(0.0), P(0.1, G(0.0)), P(0.1, L(0.0)),
                                   MOG(0.0, [1.0, 2.0], [0.5, 0.5]), ev.NonPrivateDpEvent()])
def test_a_step_without_noise_gives_no_privacy(event):
  accountant = JaxacctAccountant().compose(G(2.0)).compose(event)
  assert accountant.get_epsilon(0.01) == math.inf
  assert accountant.get_delta(1.0) == 1.0


@pytest.mark.parametrize("event", [P(0.0, G(1.0)), P(0.0, L(1.0)), P(0.0, G(0.0)),
                                   MOG(1.0, [0.0], [1.0]), MOG(0.0, [0.0], [1.0]),
                                   S(ev.NoOpDpEvent(), 5)])
def test_events_that_release_nothing_cost_nothing(event):
  accountant = JaxacctAccountant().compose(event)
  assert accountant.get_epsilon(1e-10) == 0.0 and accountant.get_delta(0.0) == 0.0


def test_settings_beyond_the_pld_grid_get_rdps_upper_bound():
  """A calibration's search may pass through sigma 0.1 (epsilon in the thousands): the PLD
  cannot plan it, RDP's upper bound answers (not an error); delta 0 gets the pure-DP bound."""
  accountant = JaxacctAccountant().compose(P(0.02, G(0.1)), 100)
  rdp = jaxacct.epsilon(jaxacct.dpsgd_composition(0.1, 0.02, 100), 1e-5, accountant="rdp")
  assert accountant.get_epsilon(1e-5) == float(rdp.upper) > 100.0
  assert JaxacctAccountant().compose(L(2.0), 3).get_epsilon(0.0) == pytest.approx(1.5, rel=1e-12)
  assert JaxacctAccountant().compose(G(2.0)).get_epsilon(0.0) == math.inf
  with pytest.raises(ValueError, match="target_delta"):
    JaxacctAccountant().compose(G(2.0)).get_epsilon(1.5)


def test_rdp_option_matches_dp_accountings_published_gaussian():
  """dp-accounting's RDP case: sigma 4.530877117 gives (1, 1e-6)-DP by RDP (orders on a 1e-3
  grid); jaxacct's RDP at the best continuous order gives at most that, and the certified PLD
  (the truth within its bracket) less."""
  rdp = JaxacctAccountant(accountant="rdp").compose(G(4.530877117)).get_epsilon(1e-6)
  assert 1.0 - 1e-3 <= rdp <= 1.0 + 1e-9
  assert JaxacctAccountant().compose(G(4.530877117)).get_epsilon(1e-6) < rdp


# Compositions to export: fixed-batch steps (sensitivity 2), a Gaussian with its own
# sensitivity, Laplace, sampled Laplace and a no-op entry, DP-SGD and randomized response under
# replace-one (one randomized-response step: dp-accounting 0.6.0's PLD composes a self-composed
# one once, whatever its count).
EXPORTS = [
    (jaxacct.Composition.of((jaxacct.PoissonSampled(jaxacct.Gaussian(1.1, 2.0), 0.05), 300)),
     "add_remove"),
    (jaxacct.Composition.of((jaxacct.Gaussian(3.0, 0.5), 7), jaxacct.Laplace(4.0, 2.0),
                            (jaxacct.PoissonSampled(jaxacct.Laplace(2.0), 0.1), 30),
                            (jaxacct.PureDP(0.0), 9)), "add_remove"),
    (jaxacct.dpsgd_composition(0.9, 0.02, 500, relation="replace_one"), "replace_one"),
    (jaxacct.Composition.of((jaxacct.Gaussian(5.0), 20), jaxacct.RandomizedResponse(0.5, 4.0)),
     "replace_one"),
]


def _same_mechanisms(a, b):
  """Whether two compositions hold the same privacy-loss laws with the same counts (each
  entry's loss distribution, both directions, on a grid of losses), no-op entries aside."""
  def entries(composition):
    return [(m, int(c)) for m, c in zip(composition.mechanisms, composition.counts) if int(c)
            and not (isinstance(m, jaxacct.EpsilonDelta) and float(m.epsilon) == 0.0)]
  losses = np.linspace(-6.0, 6.0, 61)
  with jax.enable_x64(True):
    laws = lambda m: np.concatenate([np.ravel(m.cdf_sf(losses, add)) for add in (False, True)])
    pairs = list(zip(entries(a), entries(b)))
    return (len(entries(a)) == len(entries(b)) == len(pairs)
            and all(ca == cb and np.allclose(laws(ma), laws(mb), rtol=1e-12, atol=1e-300)
                    for (ma, ca), (mb, cb) in pairs))


@pytest.mark.parametrize("composition, relation", EXPORTS, ids=range(len(EXPORTS)))
def test_to_dp_event_round_trips_and_dp_accounting_agrees(composition, relation):
  """from_dp_event(to_dp_event(c)) holds the same mechanisms (so the same epsilon), and
  dp-accounting's PLD of the exported tree lies in jaxacct's certified bracket."""
  exported = jaxacct.to_dp_event(composition, relation=relation)
  assert _same_mechanisms(jaxacct.from_dp_event(exported, relation=relation), composition)
  ours = jaxacct.epsilon(composition, 1e-6)
  dp_relation = ADD_REMOVE if relation == "add_remove" else REPLACE_ONE
  theirs = _dp_accounting_pld(exported, 1e-6, dp_relation)
  # Their pessimistic PLD is above the truth, by at most its grid's rounding (1e-4 a step for
  # the atoms of Laplace and randomized response).
  assert float(ours.lower) <= theirs + 1e-9
  assert theirs <= float(ours.upper) + 3e-3


def test_round_trip_gives_the_same_epsilon():
  composition = EXPORTS[0][0]
  back = jaxacct.from_dp_event(jaxacct.to_dp_event(composition))
  assert (float(jaxacct.epsilon(back, 1e-6).upper)
          == pytest.approx(float(jaxacct.epsilon(composition, 1e-6).upper), abs=1e-12))


def test_to_dp_event_writes_what_a_user_would():
  fixed = EXPORTS[0][0]
  assert jaxacct.to_dp_event(fixed) == S(P(0.05, G(0.55)), 300)
  assert jaxacct.to_dp_event(jaxacct.Composition.of(jaxacct.Gaussian(2.0), (jaxacct.Laplace(1.0),
                                                                             2))) == C(
      [G(2.0), S(L(1.0), 2)])
  assert jaxacct.to_dp_event(jaxacct.Composition.of((jaxacct.PureDP(0.0), 0))) == ev.NoOpDpEvent()
  mixture = jaxacct.MixtureOfGaussians(2.0, [0.0, 1.0, 2.0], [0.5, 0.3, 0.2])
  exported = jaxacct.to_dp_event(jaxacct.Composition.of((mixture, 20)))
  assert exported == S(MOG(2.0, [0.0, 1.0, 2.0], [0.5, 0.3, 0.2]), 20)
  assert _same_mechanisms(jaxacct.from_dp_event(exported), jaxacct.Composition.of((mixture, 20)))


@pytest.mark.parametrize("composition, relation, why", [
    (jaxacct.dpsgd_composition(1.0, 0.01, 10), "replace_one", "add_remove"),
    (jaxacct.dpsgd_composition(1.0, 0.01, 10, relation="replace_one"), "add_remove",
     "replace_one"),
    (jaxacct.Composition.of(jaxacct.RandomizedResponse(0.5, 3.0)), "add_remove", "replace_one"),
    (jaxacct.Composition.of(jaxacct.PoissonSampled(
        jaxacct.MixtureOfGaussians(1.0, [0.0, 1.0], [0.5, 0.5]), 0.1)), "add_remove",
     "Gaussian or Laplace"),
    (jaxacct.dpsgd_composition([1.0, 2.0], 0.01, 10), "add_remove", "shape"),
    (jaxacct.Composition.of((jaxacct.Gaussian(1.0), 2.5)), "add_remove", "whole"),
])
def test_to_dp_event_refuses_what_dp_accounting_cannot_say(composition, relation, why):
  with pytest.raises(ValueError, match=why):
    jaxacct.to_dp_event(composition, relation=relation)


@pytest.mark.parametrize("sampler, batch", [("poisson", 50), ("fixed", 50), ("full", None)])
def test_a_training_configs_event_is_what_it_is_accounted_as(sampler, batch):
  from jaxacct.training import DPConfig
  config = DPConfig(num_examples=1000, noise_multiplier=1.1, clip_norm=1.0, batch_size=batch,
                    steps=400, sampler=sampler)
  event = config.dp_event(250)
  back = jaxacct.from_dp_event(event)
  mine, theirs = config.composition(250).mechanisms[0], back.mechanisms[0]
  gaussian = lambda m: m.base if isinstance(m, jaxacct.PoissonSampled) else m
  assert [int(c) for c in back.counts] == [250]
  assert type(mine) is type(theirs)
  ratio = lambda m: float(gaussian(m).sigma) / float(gaussian(m).sensitivity)
  assert ratio(theirs) == pytest.approx(ratio(mine), rel=1e-15)
  assert float(getattr(theirs, "rate", 1.0)) == config.sampling_rate
  with pytest.raises(ValueError, match="capacity"):
    DPConfig(num_examples=1000, noise_multiplier=1.1, clip_norm=1.0, batch_size=50, steps=10,
             capacity=200).dp_event()


def test_jax_privacy_calibration_runs_on_jaxacct():
  """jax_privacy's own noise calibration case (batch 1024 of 50,000, 10^4 updates, delta 1e-5,
  target 2.27535: sigma 4 by its RDP) with the jaxacct config: a sigma whose certified epsilon
  is within the target, next to the one its PLD config finds."""
  accounting = pytest.importorskip("jax_privacy.accounting")
  from jaxacct.interop import JaxacctAccountantConfig
  case = dict(target_epsilon=2.27535, batch_sizes=1024, num_updates=10_000, num_samples=50_000,
              target_delta=1e-5, tol=1e-4)
  ours = accounting.calibrate_noise_multiplier(
      accountant=accounting.DpsgdTrainingAccountant(JaxacctAccountantConfig()), **case)
  theirs = accounting.calibrate_noise_multiplier(
      accountant=accounting.DpsgdTrainingAccountant(accounting.PldAccountantConfig()), **case)
  certified = jaxacct.dpsgd_epsilon(ours, 1024 / 50_000, 10_000, 1e-5)
  assert float(certified.upper) <= 2.27535
  assert ours == pytest.approx(theirs, rel=1e-3) and ours < 4.0
  with pytest.raises(ValueError, match="gdp"):
    JaxacctAccountantConfig(accountant="gdp")
