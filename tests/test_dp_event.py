"""DpEvent interop: dp-accounting's event trees become the same jaxacct compositions, so both
accountants give the same epsilon (within their brackets), under add/remove and under
replace-one adjacency; events jaxacct cannot express are refused by name."""

import pytest

import jaxacct

dp_accounting = pytest.importorskip("dp_accounting")
from dp_accounting import dp_event as ev  # noqa: E402
from dp_accounting import privacy_accountant  # noqa: E402
from dp_accounting.pld import pld_privacy_accountant  # noqa: E402

G, L = ev.GaussianDpEvent, ev.LaplaceDpEvent
P, S, C = ev.PoissonSampledDpEvent, ev.SelfComposedDpEvent, ev.ComposedDpEvent

TREES = [
    S(P(0.01, G(1.0)), 1000),
    S(G(5.0), 20),
    C([S(P(0.02, G(0.9)), 300), S(P(0.01, G(1.2)), 500)]),          # a heterogeneous schedule
    S(C([S(P(0.05, G(2.0)), 10), G(8.0)]), 5),                       # nested
    C([S(L(20.0), 5), S(P(0.01, G(1.0)), 200)]),
    S(P(0.1, L(2.0)), 30),
    S(P(0.005, G(0.7)), 2000),
    C([ev.NoOpDpEvent(), S(G(3.0), 4), S(ev.NoOpDpEvent(), 7)]),
    # (A mixture-of-Gaussians event: test_group checks its conversion against group_epsilon,
    # and test_mixture the mixture's epsilon against dp-accounting's, stored; dp-accounting
    # takes 11-35 s to build one mixture's PLD.)
    C([S(P(1.0, G(4.0)), 3), S(P(0.0, G(0.5)), 100)]),               # q = 1 and q = 0
]
DELTA = 1e-6


def _theirs(event):
  accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
  accountant.compose(event)
  return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("event", TREES, ids=range(len(TREES)))
def test_same_epsilon_as_dp_accounting(event):
  ours = jaxacct.epsilon(jaxacct.from_dp_event(event), DELTA)
  theirs = _theirs(event)
  assert int(ours.status) == 0
  # dp-accounting's pessimistic PLD is an upper estimate of the truth on its grid.
  assert float(ours.lower) <= theirs + 1e-9
  assert abs(float(ours.estimate) - theirs) <= 2e-3 * max(1.0, theirs), (float(ours.estimate),
                                                                          theirs)


def test_trees_map_to_the_same_mechanisms_and_counts():
  comp = jaxacct.from_dp_event(C([S(P(0.02, G(0.9)), 300), S(S(L(2.0), 2), 3)]))
  assert [type(m).__name__ for m in comp.mechanisms] == ["PoissonSampled", "Laplace"]
  assert [int(c) for c in comp.counts] == [300, 6]
  empty = jaxacct.from_dp_event(S(ev.NoOpDpEvent(), 10))
  assert float(jaxacct.epsilon(empty, 1e-5).upper) == 0.0


@pytest.mark.parametrize("event, name", [
    (ev.RandomizedResponseDpEvent(0.2, 2), "RandomizedResponseDpEvent"),
    (ev.NonPrivateDpEvent(), "NonPrivateDpEvent"),
    (ev.UnsupportedDpEvent(), "UnsupportedDpEvent"),
    (P(0.1, S(G(1.0), 2)), "PoissonSampledDpEvent"),
    (S(ev.ZCDpEvent(0.5), 3), "ZCDpEvent"),
    (G(0.0), "GaussianDpEvent"),
])
def test_events_jaxacct_cannot_express_are_refused_by_name(event, name):
  with pytest.raises(ValueError, match=name):
    jaxacct.from_dp_event(event)


def test_a_non_event_is_refused():
  with pytest.raises(ValueError, match="DpEvent"):
    jaxacct.from_dp_event(jaxacct.Gaussian(1.0))


# Replace-one: (ours, theirs, randomized-response steps). dp-accounting 0.6.0's PLD accountant
# composes a RandomizedResponseDpEvent once whatever its count (its branch ignores the count of
# an enclosing SelfComposedDpEvent), so its side spells the steps out in a ComposedDpEvent.
RR = ev.RandomizedResponseDpEvent
REPLACE_TREES = [
    (S(G(5.0), 20), None, 0),
    (S(P(0.01, G(1.0)), 1000), None, 0),
    (S(P(1.0, G(4.0)), 3), None, 0),                                  # q = 1: the Gaussian
    (RR(0.2, 2), None, 1),
    (S(RR(0.3, 10), 5), C([RR(0.3, 10)] * 5), 5),
    (C([S(P(0.02, G(0.9)), 300), S(RR(0.5, 4), 3)]),
     C([S(P(0.02, G(0.9)), 300)] + [RR(0.5, 4)] * 3), 3),
    (C([S(RR(0.6, 3), 20), S(G(10.0), 4), RR(0.3, 1), S(P(0.0, G(0.5)), 9)]),
     C([RR(0.6, 3)] * 20 + [S(G(10.0), 4), RR(0.3, 1), S(P(0.0, G(0.5)), 9)]), 20),
]


def _theirs_replace_one(event, delta):
  accountant = pld_privacy_accountant.PLDAccountant(
      privacy_accountant.NeighboringRelation.REPLACE_ONE, value_discretization_interval=1e-4)
  accountant.compose(event)
  return accountant.get_epsilon(delta)


@pytest.mark.parametrize("ours, theirs, rr_steps", REPLACE_TREES, ids=range(len(REPLACE_TREES)))
def test_replace_one_within_the_bracket_of_dp_accounting(ours, theirs, rr_steps):
  """dp-accounting's REPLACE_ONE PLD lies in jaxacct's certified bracket, up to its own stated
  error: its pessimistic PLD is at or above the truth (so at or above our lower), by at most
  its rounding of each randomized-response step's losses up to its 1e-4 grid (connect-the-dots
  for the Gaussians: far less; 2e-5 allowed)."""
  r = jaxacct.epsilon(jaxacct.from_dp_event(ours, relation="replace_one"), DELTA)
  reference = _theirs_replace_one(theirs or ours, DELTA)
  assert int(r.status) == 0
  assert float(r.lower) <= reference + 1e-9, (float(r.lower), reference)
  assert reference <= float(r.upper) + rr_steps * 1e-4 + 2e-5, (float(r.upper), reference)


def test_replace_one_is_not_add_remove():
  """A replace-one Gaussian moves the mean by twice the sensitivity: its epsilon is that of
  sigma / 2 under add/remove, not the add/remove epsilon."""
  event = S(G(4.0), 10)
  replace = jaxacct.epsilon(jaxacct.from_dp_event(event, relation="replace_one"), 1e-6)
  halved = jaxacct.epsilon(jaxacct.from_dp_event(S(G(2.0), 10)), 1e-6)
  plain = jaxacct.epsilon(jaxacct.from_dp_event(event), 1e-6)
  assert float(replace.estimate) == pytest.approx(float(halved.estimate), abs=1e-9)
  assert float(replace.lower) > float(plain.upper)


def test_replace_one_maps_to_the_replace_one_models():
  comp = jaxacct.from_dp_event(C([S(P(0.02, G(0.9)), 300), S(P(1.0, G(2.0)), 2), S(G(3.0), 4),
                                  S(RR(0.25, 6), 7), RR(0.5, 1), S(P(0.0, G(1.0)), 5)]),
                               relation="replace_one")
  assert [type(m).__name__ for m in comp.mechanisms] == [
      "SampledGaussianReplaceOne", "Gaussian", "Gaussian", "RandomizedResponse"]
  assert [int(c) for c in comp.counts] == [300, 2, 4, 7]
  assert [float(m.sensitivity) for m in comp.mechanisms[1:3]] == [2.0, 2.0]
  assert comp.symmetric
  rr = comp.mechanisms[3]
  assert (float(rr.noise), float(rr.buckets)) == (0.25, 6.0)
  # The default relation is add/remove, as before.
  assert float(jaxacct.from_dp_event(G(3.0)).mechanisms[0].sensitivity) == 1.0


@pytest.mark.parametrize("event, name, why", [
    (ev.LaplaceDpEvent(1.0), "LaplaceDpEvent", "add/remove"),
    (S(P(0.1, ev.LaplaceDpEvent(1.0)), 3), "PoissonSampledDpEvent", "GaussianDpEvent"),
    (ev.MixtureOfGaussiansDpEvent(2.0, [0.0, 1.0], [0.5, 0.5]), "MixtureOfGaussiansDpEvent",
     "add/remove"),
    (RR(0.0, 4), "RandomizedResponseDpEvent", "no privacy"),
    (ev.NonPrivateDpEvent(), "NonPrivateDpEvent", ""),
    (ev.TruncatedSubsampledGaussianDpEvent(1000, 0.01, 20, 1.0), "TruncatedSubsampledGaussian",
     ""),
    (P(0.1, G(0.0)), "GaussianDpEvent", "no privacy"),
])
def test_replace_one_refuses_what_it_cannot_express(event, name, why):
  with pytest.raises(ValueError, match=f"{name}.*{why}"):
    jaxacct.from_dp_event(event, relation="replace_one")


def test_an_unknown_relation_is_refused():
  with pytest.raises(ValueError, match="relation"):
    jaxacct.from_dp_event(G(1.0), relation="replace_special")
