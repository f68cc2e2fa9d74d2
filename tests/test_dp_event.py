"""DpEvent interop: dp-accounting's event trees become the same jaxacct compositions, so both
accountants give the same epsilon (within their brackets); events jaxacct cannot express are
refused by name."""

import pytest

import jaxacct

dp_accounting = pytest.importorskip("dp_accounting")
from dp_accounting import dp_event as ev  # noqa: E402
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
    S(ev.MixtureOfGaussiansDpEvent(2.0, [0.0, 1.0, 2.0], [0.5, 0.3, 0.2]), 20),
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
