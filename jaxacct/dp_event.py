"""Interop with dp-accounting: a ``DpEvent`` tree as a jaxacct ``Composition``.

``from_dp_event(event)`` reads the tree that dp-accounting's (and jax_privacy's) accountants
take, so a user of those libraries switches accountant with one line::

    composition = jaxacct.from_dp_event(event)
    jaxacct.epsilon(composition, 1e-5).upper

``relation`` is the neighbouring relation the events are accounted under, as dp-accounting's
``NeighboringRelation``: "add_remove" (ADD_OR_REMOVE_ONE, the default) or "replace_one"
(REPLACE_ONE). Under replace-one dp-accounting accepts the Gaussian (twice the sensitivity),
the Poisson-sampled Gaussian (the pair q N(-1, s^2) + (1-q) N(0, s^2) against its mirror,
``SampledGaussianReplaceOne``) and k-ary randomized response (``RandomizedResponse``); it refuses
Laplace, mixtures of Gaussians and Poisson-sampled Laplace, and so does jaxacct.

dp-accounting is an optional dependency (``pip install "jaxacct[dp-accounting]"``), imported
only here. Every event is translated exactly or refused: an event jaxacct cannot express raises a
``ValueError`` naming it, never a silently different composition.
"""

from __future__ import annotations

from jaxacct._inputs import check_choice
from jaxacct.api import RELATIONS
from jaxacct.composition import Composition
from jaxacct.mixture import MixtureOfGaussians
from jaxacct.models import (EpsilonDelta, Gaussian, Laplace, PoissonSampled, PureDP,
                            RandomizedResponse, SampledGaussianReplaceOne)

_ADD_REMOVE_ONLY = ("dp-accounting defines it under add/remove adjacency only (its PLD accountant "
                    "refuses it under REPLACE_ONE); use relation='add_remove'")


def _events():
  try:
    from dp_accounting import dp_event  # pylint: disable=import-outside-toplevel
  except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("from_dp_event reads dp-accounting's DpEvent: pip install "
                      "'jaxacct[dp-accounting]' (or dp-accounting)") from err
  return dp_event


def _refuse(event, why):
  return ValueError(f"jaxacct cannot express {type(event).__name__}: {why}")


def _noise(event):
  """The noise multiplier of a Gaussian or Laplace event, refused when it is 0."""
  if not event.noise_multiplier > 0:
    raise _refuse(event, "a noise multiplier of 0 gives no privacy")
  return float(event.noise_multiplier)


def _gaussian(event, relation):
  """One Gaussian step: replace-one moves the mean by twice the sensitivity."""
  return Gaussian(_noise(event), 2.0 if relation == "replace_one" else 1.0)


def _randomized_response(event, relation):
  """k-ary randomized response (replace-one only, as in dp-accounting); None for one bucket."""
  if relation != "replace_one":
    raise _refuse(event, "it is defined for the replace-one relation (dp-accounting accounts it "
                  "only so): use relation='replace_one'")
  if int(event.num_buckets) != event.num_buckets or event.num_buckets < 1:
    raise _refuse(event, f"num_buckets {event.num_buckets!r} is not a whole number >= 1")
  if event.num_buckets == 1:
    return None  # one bucket: the output is fixed, a no-op
  if not 0.0 < event.noise_parameter <= 1.0:
    raise _refuse(event, f"noise parameter {event.noise_parameter!r} outside (0, 1] (0 releases "
                  "the input: no privacy)")
  return RandomizedResponse(float(event.noise_parameter), float(event.num_buckets))


def _base(event, ev, relation):
  """The model of one step of a base mechanism event, or None for a no-op; raises for an event
  jaxacct cannot express under ``relation``."""
  if isinstance(event, ev.NoOpDpEvent):
    return None
  if isinstance(event, ev.GaussianDpEvent):
    return _gaussian(event, relation)
  if isinstance(event, ev.RandomizedResponseDpEvent):
    return _randomized_response(event, relation)
  if type(event).__name__ == "EpsilonDeltaDpEvent":  # (newer dp-accounting releases)
    # An (epsilon, delta) guarantee stated for the relation accounted under (dp-accounting
    # composes it the same way under every relation).
    return EpsilonDelta(float(event.epsilon), float(event.delta))
  if isinstance(event, (ev.LaplaceDpEvent, ev.MixtureOfGaussiansDpEvent)):
    if relation == "replace_one":
      raise _refuse(event, _ADD_REMOVE_ONLY)
    if isinstance(event, ev.LaplaceDpEvent):
      return Laplace(scale=_noise(event))
    return MixtureOfGaussians(sigma=float(event.standard_deviation),
                              sensitivities=[float(c) for c in event.sensitivities],
                              probabilities=[float(p) for p in event.sampling_probs])
  raise _refuse(event, "no jaxacct model for this event (supported: Gaussian, Laplace, "
                "PoissonSampled, SelfComposed, Composed, MixtureOfGaussians, EpsilonDelta, "
                "RandomizedResponse (replace_one), NoOp)")


def _poisson_sampled(event, ev, count, relation):
  """Entries of a Poisson-sampled event: q = 0 is a no-op, q = 1 the mechanism itself; under
  replace-one only the Gaussian (dp-accounting's ``SampledGaussianReplaceOne`` pair)."""
  q = float(event.sampling_probability)
  if relation == "replace_one":
    if not isinstance(event.event, ev.GaussianDpEvent):
      raise _refuse(event, "under replace-one dp-accounting samples only a GaussianDpEvent "
                    f"(got {type(event.event).__name__})")
    if q == 0.0:
      return []
    model = (_gaussian(event.event, relation) if q == 1.0
             else SampledGaussianReplaceOne(_noise(event.event), q))
    return [(model, count)]
  inner = _entries(event.event, ev, 1, relation)
  if q == 0.0 or not inner:
    return []
  if len(inner) != 1 or inner[0][1] != 1:
    raise _refuse(event, "Poisson sampling of a composition of several steps (sample a single "
                  "mechanism, then compose)")
  model = inner[0][0]
  return [(model if q == 1.0 else PoissonSampled(model, q), count)]


def _entries(event, ev, count, relation):
  """(model, count) entries of ``event`` composed ``count`` times."""
  if isinstance(event, ev.SelfComposedDpEvent):
    if int(event.count) != event.count or event.count < 0:
      raise _refuse(event, f"count {event.count!r} is not a whole number >= 0")
    return _entries(event.event, ev, count * int(event.count), relation)
  if isinstance(event, ev.ComposedDpEvent):
    return [entry for inner in event.events for entry in _entries(inner, ev, count, relation)]
  if isinstance(event, ev.PoissonSampledDpEvent):
    entries = _poisson_sampled(event, ev, count, relation)
    return [] if count == 0 else entries
  model = _base(event, ev, relation)
  return [] if model is None or count == 0 else [(model, count)]


def from_dp_event(event, relation="add_remove") -> Composition:
  """The jaxacct ``Composition`` of a dp-accounting ``DpEvent`` tree (exactly the same
  mechanisms and counts), accounted under ``relation`` ("add_remove" or "replace_one", as
  dp-accounting's ADD_OR_REMOVE_ONE and REPLACE_ONE). A tree of no-ops is a composition of no
  steps (epsilon = delta = 0). Raises ``ValueError`` naming an event jaxacct cannot express
  under ``relation`` (and why)."""
  check_choice("relation", relation, RELATIONS)
  ev = _events()
  if not isinstance(event, ev.DpEvent):
    raise ValueError(f"from_dp_event takes a dp_accounting DpEvent; got {type(event).__name__}")
  entries = _entries(event, ev, 1, relation)
  if not entries:
    return Composition.of((PureDP(0.0), 0))
  return Composition.of(*entries)
