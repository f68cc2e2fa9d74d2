"""Interop with dp-accounting: a ``DpEvent`` tree as a jaxacct ``Composition``.

``from_dp_event(event)`` reads the tree that dp-accounting's (and jax_privacy's) accountants
take, so a user of those libraries switches accountant with one line::

    composition = jaxacct.from_dp_event(event)
    jaxacct.epsilon(composition, 1e-5).upper

dp-accounting is an optional dependency (``pip install "jaxacct[dp-accounting]"``), imported
only here. Every event is translated exactly or refused: an event jaxacct cannot express raises a
``ValueError`` naming it, never a silently different composition.
"""

from __future__ import annotations

from jaxacct.composition import Composition
from jaxacct.mixture import MixtureOfGaussians
from jaxacct.models import EpsilonDelta, Gaussian, Laplace, PoissonSampled, PureDP


def _events():
  try:
    from dp_accounting import dp_event  # pylint: disable=import-outside-toplevel
  except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("from_dp_event reads dp-accounting's DpEvent: pip install "
                      "'jaxacct[dp-accounting]' (or dp-accounting)") from err
  return dp_event


def _refuse(event, why):
  return ValueError(f"jaxacct cannot express {type(event).__name__}: {why}")


def _base(event, ev):
  """The model of one step of a base mechanism event, or None for a no-op; raises for an event
  jaxacct cannot express."""
  if isinstance(event, ev.NoOpDpEvent):
    return None
  if isinstance(event, ev.GaussianDpEvent):
    if not event.noise_multiplier > 0:
      raise _refuse(event, "a noise multiplier of 0 gives no privacy")
    return Gaussian(float(event.noise_multiplier))
  if isinstance(event, ev.LaplaceDpEvent):
    if not event.noise_multiplier > 0:
      raise _refuse(event, "a noise multiplier of 0 gives no privacy")
    return Laplace(scale=float(event.noise_multiplier))
  if isinstance(event, ev.RandomizedResponseDpEvent):
    raise _refuse(event, "it is defined for the replace-one relation (dp-accounting accounts it "
                  "only so), and from_dp_event builds add/remove compositions")
  if isinstance(event, ev.MixtureOfGaussiansDpEvent):
    return MixtureOfGaussians(sigma=float(event.standard_deviation),
                              sensitivities=[float(c) for c in event.sensitivities],
                              probabilities=[float(p) for p in event.sampling_probs])
  if type(event).__name__ == "EpsilonDeltaDpEvent":  # (newer dp-accounting releases)
    return EpsilonDelta(float(event.epsilon), float(event.delta))
  raise _refuse(event, "no jaxacct model for this event (supported: Gaussian, Laplace, "
                "PoissonSampled, SelfComposed, Composed, MixtureOfGaussians, EpsilonDelta, NoOp)")


def _entries(event, ev, count):
  """(model, count) entries of ``event`` composed ``count`` times."""
  if isinstance(event, ev.SelfComposedDpEvent):
    if int(event.count) != event.count or event.count < 0:
      raise _refuse(event, f"count {event.count!r} is not a whole number >= 0")
    return _entries(event.event, ev, count * int(event.count))
  if isinstance(event, ev.ComposedDpEvent):
    return [entry for inner in event.events for entry in _entries(inner, ev, count)]
  if isinstance(event, ev.PoissonSampledDpEvent):
    q = float(event.sampling_probability)
    inner = _entries(event.event, ev, 1)
    if q == 0.0 or not inner:
      return []
    if len(inner) != 1 or inner[0][1] != 1:
      raise _refuse(event, "Poisson sampling of a composition of several steps (sample a single "
                    "mechanism, then compose)")
    model = inner[0][0]
    return [(model if q == 1.0 else PoissonSampled(model, q), count)]
  model = _base(event, ev)
  return [] if model is None or count == 0 else [(model, count)]


def from_dp_event(event) -> Composition:
  """The jaxacct ``Composition`` of a dp-accounting ``DpEvent`` tree (exactly the same
  mechanisms and counts). A tree of no-ops is a composition of no steps (epsilon = delta = 0).
  Raises ``ValueError`` naming an event jaxacct cannot express."""
  ev = _events()
  if not isinstance(event, ev.DpEvent):
    raise ValueError(f"from_dp_event takes a dp_accounting DpEvent; got {type(event).__name__}")
  entries = _entries(event, ev, 1)
  if not entries:
    return Composition.of((PureDP(0.0), 0))
  return Composition.of(*entries)
