"""Interop with dp-accounting: a ``DpEvent`` tree as a jaxacct ``Composition``, and back.

``from_dp_event(event)`` reads the tree that dp-accounting's (and jax_privacy's) accountants
take, so a user of those libraries switches accountant with one line::

    composition = jaxacct.from_dp_event(event)
    jaxacct.epsilon(composition, 1e-5).upper

``to_dp_event(composition)`` writes the tree a dp-accounting user would have written for a
composition (``from_dp_event`` of it is the same composition), and ``event_entries`` is the
translation both ``from_dp_event`` and ``jaxacct.interop.JaxacctAccountant`` read.

``relation`` is the neighbouring relation the events are accounted under, as dp-accounting's
``NeighboringRelation``: "add_remove" (ADD_OR_REMOVE_ONE, the default) or "replace_one"
(REPLACE_ONE). Under replace-one dp-accounting accepts the Gaussian (twice the sensitivity),
the Poisson-sampled Gaussian (the pair q N(-1, s^2) + (1-q) N(0, s^2) against its mirror,
``SampledGaussianReplaceOne``) and k-ary randomized response (``RandomizedResponse``); it refuses
Laplace, mixtures of Gaussians and Poisson-sampled Laplace, and so does jaxacct.

A mechanism without noise (a noise multiplier of 0, ``NonPrivateDpEvent``) gives no privacy:
``event_entries`` marks it ``non_private`` (dp-accounting's accountants then answer epsilon =
inf), and ``from_dp_event`` refuses it, since a ``Composition`` holds only private mechanisms.

dp-accounting is an optional dependency (``pip install "jaxacct[dp-accounting]"``), imported
only here. Every event is translated exactly or refused: an event jaxacct cannot express raises a
``ValueError`` naming it, never a silently different composition.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxacct._inputs import check_choice
from jaxacct._numerics import is_traced
from jaxacct.api import RELATIONS
from jaxacct.composition import Composition, as_composition
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


class NonPrivate(NamedTuple):
  """In place of an entry's model: a step that releases its input without noise (epsilon =
  inf), named by its event."""

  event: str


class Translation(NamedTuple):
  """What a ``DpEvent`` tree composes: its (model, count) entries, and the names of the events
  that release their input without noise (``non_private``; any: no finite epsilon)."""

  entries: list
  non_private: tuple


def _noise(event):
  """The noise multiplier of a Gaussian or Laplace event; None (no privacy) when it is 0."""
  if event.noise_multiplier == 0:
    return None
  if not event.noise_multiplier > 0:
    raise _refuse(event, f"noise multiplier {event.noise_multiplier!r} is not >= 0")
  return float(event.noise_multiplier)


def _gaussian(event, relation):
  """One Gaussian step: replace-one moves the mean by twice the sensitivity."""
  sigma = _noise(event)
  if sigma is None:
    return NonPrivate(type(event).__name__)
  return Gaussian(sigma, 2.0 if relation == "replace_one" else 1.0)


def _randomized_response(event, relation):
  """k-ary randomized response (replace-one only, as in dp-accounting); None for one bucket."""
  if relation != "replace_one":
    raise _refuse(event, "it is defined for the replace-one relation (dp-accounting accounts it "
                  "only so): use relation='replace_one'")
  if int(event.num_buckets) != event.num_buckets or event.num_buckets < 1:
    raise _refuse(event, f"num_buckets {event.num_buckets!r} is not a whole number >= 1")
  if event.num_buckets == 1:
    return None  # one bucket: the output is fixed, a no-op
  if event.noise_parameter == 0:
    return NonPrivate(type(event).__name__)  # (0 releases the input)
  if not 0.0 < event.noise_parameter <= 1.0:
    raise _refuse(event, f"noise parameter {event.noise_parameter!r} outside [0, 1]")
  return RandomizedResponse(float(event.noise_parameter), float(event.num_buckets))


def _mixture(event):
  """A mixture of Gaussians; None when every sensitivity is 0 (the same law with or without
  the user), no privacy at standard deviation 0."""
  sensitivities = [float(c) for c in event.sensitivities]
  if not any(sensitivities):
    return None
  if event.standard_deviation == 0:
    return NonPrivate(type(event).__name__)
  return MixtureOfGaussians(sigma=float(event.standard_deviation), sensitivities=sensitivities,
                            probabilities=[float(p) for p in event.sampling_probs])


def _base(event, ev, relation):
  """The model of one step of a base mechanism event, None for a no-op, ``NonPrivate`` for no
  privacy; raises for an event jaxacct cannot express under ``relation``."""
  if isinstance(event, ev.NoOpDpEvent):
    return None
  if isinstance(event, ev.NonPrivateDpEvent):
    return NonPrivate(type(event).__name__)
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
    if isinstance(event, ev.MixtureOfGaussiansDpEvent):
      return _mixture(event)
    scale = _noise(event)
    return NonPrivate(type(event).__name__) if scale is None else Laplace(scale=scale)
  raise _refuse(event, "no jaxacct model for this event (supported: Gaussian, Laplace, "
                "PoissonSampled, SelfComposed, Composed, MixtureOfGaussians, EpsilonDelta, "
                "RandomizedResponse (replace_one), NoOp)")


def _sampled(model, q):
  """A model Poisson-sampled at ``q``: the model itself at q = 1 (no privacy stays none)."""
  return model if q == 1.0 or isinstance(model, NonPrivate) else PoissonSampled(model, q)


def _poisson_sampled(event, ev, count, relation):
  """Entries of a Poisson-sampled event: q = 0 is a no-op, q = 1 the mechanism itself; under
  replace-one only the Gaussian (dp-accounting's ``SampledGaussianReplaceOne`` pair)."""
  q = float(event.sampling_probability)
  if not 0.0 <= q <= 1.0:
    raise _refuse(event, f"sampling probability {q!r} outside [0, 1]")
  if relation == "replace_one":
    if not isinstance(event.event, ev.GaussianDpEvent):
      raise _refuse(event, "under replace-one dp-accounting samples only a GaussianDpEvent "
                    f"(got {type(event.event).__name__})")
    if q == 0.0:
      return []
    if q == 1.0:
      return [(_gaussian(event.event, relation), count)]
    sigma = _noise(event.event)
    model = (NonPrivate(type(event.event).__name__) if sigma is None
             else SampledGaussianReplaceOne(sigma, q))
    return [(model, count)]
  inner = _entries(event.event, ev, 1, relation)
  if len(inner) > 1 or (inner and inner[0][1] != 1):
    raise _refuse(event, "Poisson sampling of a composition of several steps (sample a single "
                  "mechanism, then compose)")
  if q == 0.0 or not inner:
    return []
  return [(_sampled(inner[0][0], q), count)]


def _entries(event, ev, count, relation):
  """(model, count) entries of ``event`` composed ``count`` times (``NonPrivate`` models for
  steps without noise)."""
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


def event_entries(event, relation="add_remove") -> Translation:
  """The ``Translation`` of ``event`` under ``relation`` (as in ``from_dp_event``): its private
  (model, count) entries and the events whose steps give no privacy. Raises ``ValueError``
  naming an event jaxacct cannot express under ``relation`` (and why)."""
  check_choice("relation", relation, RELATIONS)
  ev = _events()
  if not isinstance(event, ev.DpEvent):
    raise ValueError(f"a dp_accounting DpEvent is needed; got {type(event).__name__}")
  entries = _entries(event, ev, 1, relation)
  private = [(model, n) for model, n in entries if not isinstance(model, NonPrivate)]
  return Translation(private, tuple(m.event for m, _ in entries if isinstance(m, NonPrivate)))


def from_dp_event(event, relation="add_remove") -> Composition:
  """The jaxacct ``Composition`` of a dp-accounting ``DpEvent`` tree (exactly the same
  mechanisms and counts), accounted under ``relation`` ("add_remove" or "replace_one", as
  dp-accounting's ADD_OR_REMOVE_ONE and REPLACE_ONE). A tree of no-ops is a composition of no
  steps (epsilon = delta = 0). Raises ``ValueError`` naming an event jaxacct cannot express
  under ``relation`` (and why), and for a step without noise (no privacy to account)."""
  entries, non_private = event_entries(event, relation)
  if non_private:
    raise ValueError(f"jaxacct cannot express {non_private[0]} here: a step with no privacy (a "
                     "noise of 0 or a NonPrivateDpEvent: epsilon is infinite) is not a "
                     "Composition entry (jaxacct.interop.JaxacctAccountant answers inf for it)")
  if not entries:
    return Composition.of((PureDP(0.0), 0))
  return Composition.of(*entries)


def _scalar(name, value):
  """A concrete scalar parameter as a float (an event holds one setting, not a batch)."""
  if is_traced(value):
    raise ValueError(f"to_dp_event needs concrete values; {name} is traced (call it outside "
                     "jit/vmap/grad)")
  array = np.asarray(value, dtype=float)
  if array.ndim:
    raise ValueError(f"to_dp_event exports one setting; {name} has shape {array.shape} (index "
                     "the batch first)")
  return float(array)


def _cannot_export(model, relation, why):
  return ValueError(f"to_dp_event cannot write {type(model).__name__} under relation="
                    f"{relation!r}: {why}")


def _unit_noise(model, noise="sigma"):
  """A noise parameter per unit of sensitivity: dp-accounting's events have sensitivity 1 (a
  Gaussian's or Laplace's epsilon depends on noise / sensitivity only)."""
  return _scalar(noise, getattr(model, noise)) / _scalar("sensitivity", model.sensitivity)


def _gaussian_event(ev, model, relation):
  """A Gaussian of any sensitivity as dp-accounting's unit-sensitivity event; under
  replace-one the event's shift is 2."""
  ratio = _unit_noise(model)
  return ev.GaussianDpEvent(2.0 * ratio if relation == "replace_one" else ratio)


def _model_event(ev, model, relation):
  """The ``DpEvent`` of one step of ``model`` under ``relation``; raises where dp-accounting
  has no event for that pair (or defines it under the other relation only)."""
  add_remove = relation == "add_remove"
  if isinstance(model, Gaussian):
    return _gaussian_event(ev, model, relation)
  if isinstance(model, EpsilonDelta):
    epsilon, delta = _scalar("epsilon", model.epsilon), _scalar("delta", model.delta)
    if epsilon == 0.0 and delta == 0.0:
      return ev.NoOpDpEvent()
    if not hasattr(ev, "EpsilonDeltaDpEvent"):
      raise _cannot_export(model, relation, "this dp-accounting release has no "
                           "EpsilonDeltaDpEvent")
    return ev.EpsilonDeltaDpEvent(epsilon, delta)
  if isinstance(model, Laplace) and add_remove:
    return ev.LaplaceDpEvent(_unit_noise(model, "scale"))
  if isinstance(model, MixtureOfGaussians) and add_remove:
    sensitivities, probabilities = (np.asarray(model.sensitivities, float),
                                    np.asarray(model.probabilities, float))
    if sensitivities.ndim != 1:
      raise ValueError("to_dp_event exports one setting; the mixture holds a batch (index it "
                       "first)")
    return ev.MixtureOfGaussiansDpEvent(_scalar("sigma", model.sigma), sensitivities.tolist(),
                                        probabilities.tolist())
  if isinstance(model, PoissonSampled) and add_remove:
    inner = _model_event(ev, model.base, relation)
    if not isinstance(inner, (ev.GaussianDpEvent, ev.LaplaceDpEvent)):
      raise _cannot_export(model, relation, "dp-accounting samples only a Gaussian or Laplace "
                           f"event (the base is {type(model.base).__name__})")
    return ev.PoissonSampledDpEvent(_scalar("rate", model.rate), inner)
  if isinstance(model, SampledGaussianReplaceOne) and not add_remove:
    return ev.PoissonSampledDpEvent(_scalar("rate", model.rate),
                                    ev.GaussianDpEvent(_unit_noise(model)))
  if isinstance(model, RandomizedResponse) and not add_remove:
    return ev.RandomizedResponseDpEvent(_scalar("noise", model.noise),
                                        int(_scalar("buckets", model.buckets)))
  if isinstance(model, (PoissonSampled, Laplace, MixtureOfGaussians, SampledGaussianReplaceOne,
                        RandomizedResponse)):
    other = "replace_one" if add_remove else "add_remove"
    raise _cannot_export(model, relation, "dp-accounting defines its event for "
                         f"relation={other!r} only (a different pair of distributions)")
  raise _cannot_export(model, relation, "dp-accounting has no event for this model")


def _counted(ev, event, count):
  """``event`` composed ``count`` times: itself once, a ``SelfComposedDpEvent`` otherwise."""
  return event if count == 1 else ev.SelfComposedDpEvent(event, count)


def to_dp_event(composition, relation="add_remove"):
  """The dp-accounting ``DpEvent`` tree of a composition (one concrete setting), as a
  dp-accounting user would write it for ``relation``: each entry's event (``GaussianDpEvent``,
  ``PoissonSampledDpEvent``, ``LaplaceDpEvent``, ...) in a ``SelfComposedDpEvent`` of its count,
  several entries in a ``ComposedDpEvent`` (no-op entries dropped). ``from_dp_event`` of the
  result under the same relation is the same composition (the same epsilon). A model dp-accounting
  has no event for under ``relation`` (e.g. ``PoissonSampled`` under "replace_one", whose pair is
  the add/remove one) raises ``ValueError`` saying why."""
  check_choice("relation", relation, RELATIONS)
  ev = _events()
  composition = as_composition(composition)
  events = []
  for model, count in zip(composition.mechanisms, composition.counts):
    steps = _scalar("count", count)
    if steps != int(steps) or steps < 0:
      raise ValueError(f"to_dp_event needs whole counts >= 0; got {steps!r}")
    event = _model_event(ev, model, relation)
    if steps and not isinstance(event, ev.NoOpDpEvent):
      events.append(_counted(ev, event, int(steps)))
  if not events:
    return ev.NoOpDpEvent()
  return events[0] if len(events) == 1 else ev.ComposedDpEvent(events)
