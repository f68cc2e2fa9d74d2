"""A dp-accounting ``PrivacyAccountant`` whose answers are jaxacct's certified upper bounds.

Code written for dp-accounting's accountants runs unchanged::

    from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent
    from jaxacct.interop import JaxacctAccountant

    accountant = JaxacctAccountant()           # the certified PLD accountant, eps_error 0.01
    accountant.compose(PoissonSampledDpEvent(0.01, GaussianDpEvent(1.0)), 10_000)
    accountant.get_epsilon(1e-5)               # certified: the true epsilon is at most this

It accepts exactly the events ``jaxacct.from_dp_event`` translates (``supports`` and
``compose`` refuse the rest, naming the event and why) plus the steps without noise that
dp-accounting also accepts (a noise multiplier of 0, ``NonPrivateDpEvent``: epsilon = inf,
delta = 1). For mechanisms whose privacy loss is bounded (Laplace, randomized response, pure DP,
subsampled or not) the answers are also capped by the pure-DP bound, the sum over steps of the
largest loss: delta is 0 beyond it, and it certifies epsilon at deltas below what the PLD's grid
resolves (where its own upper is +inf) and at delta = 0. Where the PLD accountant cannot plan a
setting (an epsilon in the hundreds or more, far beyond what its grid spans) the RDP upper bound
answers instead of an error, so a calibration's search can pass through such settings.
Composition is incremental, as in dp-accounting: each ``compose`` adds to a ledger
of (mechanism, count) entries (a repeated event adds to its entry's count), and each query
composes the ledger once (answers are kept until the next ``compose``). The PLD accountant's
plans share one ``SizeCache`` across every ``JaxacctAccountant`` of the process, so the
accountants a calibration creates for nearby settings (jax_privacy makes a fresh one per
evaluation) reuse one compiled program instead of compiling their own; a reused plan is at least
as fine as the setting's own, so the bounds stay certified.
"""

from __future__ import annotations

import math

import dp_accounting
import jax
import numpy as np

from jaxacct import api, pld
from jaxacct._inputs import check_choice, check_delta, check_epsilon
from jaxacct.cgf import check_cgf
from jaxacct.composition import Composition
from jaxacct.dp_event import event_entries
from jaxacct.results import Bounds

NeighboringRelation = dp_accounting.NeighboringRelation
RELATIONS = {NeighboringRelation.ADD_OR_REMOVE_ONE: "add_remove",
             NeighboringRelation.REPLACE_ONE: "replace_one"}
# The accountants whose upper bound is a certificate (GDP's is none for subsampled steps).
CERTIFYING = ("pld", "rdp", "spa", "edgeworth")
# Compiled PLD sizes offered to every accountant of the process (see the module docstring).
SHARED_SIZES = pld.SizeCache()


def _key(model):
  """A hashable identity of a model's type and parameter values (equal models share a count)."""
  leaves, treedef = jax.tree_util.tree_flatten(model)
  return treedef, tuple(tuple(np.ravel(np.asarray(leaf, float)).tolist()) for leaf in leaves)


def pure_epsilon(composition: Composition) -> float:
  """The pure-DP epsilon of a composition: the sum over steps of the largest finite loss of
  either direction (delta = 0 at it and beyond); inf where a loss is unbounded (a Gaussian) or
  has mass at infinity (delta > 0)."""
  total = 0.0
  with jax.enable_x64(True):  # (the models' bounds are rounded up in float64)
    for model, count in zip(composition.mechanisms, composition.counts):
      if not np.any(np.asarray(count)):
        continue
      for add in (False, True):
        if np.any(np.asarray(model.inf_mass(add)) > 0.0):
          return math.inf
      largest = max(float(np.max(np.asarray(model.max_loss(add)))) for add in (False, True))
      total += float(np.max(np.asarray(count))) * largest
  return total


def _rdp_or_nothing(kind, composition, target) -> Bounds:
  """RDP's bounds (an upper bound only) of a composition, or no bound (+inf epsilon, delta 1)
  where RDP cannot account it either."""
  try:
    check_cgf(composition)
  except ValueError:
    inf, nan = np.float64(np.inf), np.float64(np.nan)
    return Bounds(nan, nan, inf if kind == "epsilon" else np.float64(1.0), np.int32(0))
  query = api.epsilon if kind == "epsilon" else api.delta
  return query(composition, target, accountant="rdp")


def _relation(neighboring_relation):
  if neighboring_relation not in RELATIONS:
    raise ValueError(f"neighboring_relation {neighboring_relation!r} is not supported: jaxacct "
                     "accounts ADD_OR_REMOVE_ONE and REPLACE_ONE")
  return RELATIONS[neighboring_relation]


class JaxacctAccountant(dp_accounting.PrivacyAccountant):
  """``dp_accounting.PrivacyAccountant`` on jaxacct: ``get_epsilon`` / ``get_delta`` return the
  certified upper bound of the chosen accountant.

  Args:
    neighboring_relation: ``NeighboringRelation.ADD_OR_REMOVE_ONE`` (the default; the worse of
      adding and removing one record, as dp-accounting) or ``REPLACE_ONE``.
    accountant: "pld" (the certified FFT accountant, the default), "rdp" (an upper bound from
      Renyi DP), "spa" or "edgeworth" (certified from their error bounds; +inf where those are
      vacuous). "gdp" is refused: it certifies no bound for subsampled steps.
    eps_error: the PLD accountant's target half-width of its certified epsilon bracket (default
      0.01); refused by the other accountants.
  """

  def __init__(self, neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE, *,
               accountant="pld", eps_error=None):
    relation = _relation(neighboring_relation)
    if accountant == "gdp":
      raise ValueError("accountant 'gdp' certifies no bound for subsampled steps (a central-"
                       f"limit estimate); choose one of {', '.join(CERTIFYING)}")
    check_choice("accountant", accountant, CERTIFYING)
    if eps_error is not None and accountant != "pld":
      raise ValueError(f"eps_error is the PLD accountant's accuracy; the {accountant!r} "
                       "accountant does not take it")
    super().__init__(neighboring_relation)
    self._relation = relation
    self._accountant = accountant
    self._eps_error = eps_error
    self._ledger_entries = {}  # model key -> [model, count]
    self._non_private = False
    self._answers = {}  # what the ledger's current state gives (cleared by each compose)

  @property
  def accountant(self) -> str:
    """The jaxacct accountant that answers ("pld", "rdp", "spa" or "edgeworth")."""
    return self._accountant

  def _check(self, entries):
    """Raises ValueError where the chosen accountant cannot account these entries."""
    if entries and self._accountant != "pld":
      check_cgf(Composition.of(*entries))

  def _maybe_compose(self, event, count, do_compose):
    """dp-accounting's hook: checks ``event`` (returning why it is refused) and, when
    ``do_compose``, adds it ``count`` times to the ledger."""
    try:
      entries, non_private = event_entries(event, self._relation)
      self._check(entries)
    except ValueError as err:
      return self.CompositionErrorDetails(invalid_event=event, error_message=str(err))
    if do_compose and count:
      self._add(entries, int(count), bool(non_private))
    return None

  def _add(self, entries, count, non_private):
    self._non_private |= non_private
    for model, steps in entries:
      entry = self._ledger_entries.setdefault(_key(model), [model, 0])
      entry[1] += int(steps) * count
    self._answers.clear()

  def composition(self) -> Composition | None:
    """The jaxacct ``Composition`` of what was composed (None before any private step); built
    once per ledger state."""
    if "composition" not in self._answers:
      entries = [(model, steps) for model, steps in self._ledger_entries.values() if steps]
      self._answers["composition"] = Composition.of(*entries) if entries else None
    return self._answers["composition"]

  def _bounds(self, kind, target) -> Bounds:
    key = (kind, float(target))
    if key not in self._answers:
      self._answers[key] = self._query(kind, target)
    return self._answers[key]

  def _pure_epsilon(self) -> float:
    if "pure" not in self._answers:
      self._answers["pure"] = pure_epsilon(self.composition())
    return self._answers["pure"]

  def _query(self, kind, target) -> Bounds:
    """The chosen accountant's ``Bounds`` of ``kind`` ("epsilon" or "delta") at ``target``;
    RDP's (an upper bound) where the PLD accountant cannot plan the setting (a loss spanning
    more than its grid serves), +inf's where neither can."""
    if kind == "epsilon":
      check_delta(target, "target_delta")
    else:
      check_epsilon(target, "target_epsilon")
    composition = self.composition()
    if self._accountant != "pld":
      query = api.epsilon if kind == "epsilon" else api.delta
      return query(composition, target, accountant=self._accountant)
    query = pld.epsilon if kind == "epsilon" else pld.delta
    options = {} if self._eps_error is None else {"eps_error": self._eps_error}
    try:
      return query(composition, target, size_cache=SHARED_SIZES, **options)
    except ValueError:  # (the planner's refusal: epsilon far beyond what a grid can serve)
      return _rdp_or_nothing(kind, composition, target)

  def epsilon_bounds(self, target_delta) -> Bounds | None:
    """jaxacct's ``Bounds`` (lower, estimate, upper, status) of epsilon at ``target_delta``;
    None when nothing private was composed (or a step gave no privacy)."""
    if self._non_private or self.composition() is None:
      return None
    return self._bounds("epsilon", target_delta)

  def delta_bounds(self, target_epsilon) -> Bounds | None:
    """jaxacct's ``Bounds`` of delta at ``target_epsilon``; None as in ``epsilon_bounds``."""
    if self._non_private or self.composition() is None:
      return None
    return self._bounds("delta", target_epsilon)

  def get_epsilon(self, target_delta: float) -> float:
    """The certified upper epsilon at ``target_delta`` of everything composed (capped by the
    pure-DP bound): inf after a step without privacy (or where no certificate holds), 0 before
    any step."""
    if self._non_private:
      return math.inf
    if target_delta == 0 and self.composition() is not None:
      return self._pure_epsilon()  # (delta 0: only a bounded loss has a finite epsilon)
    bounds = self.epsilon_bounds(target_delta)
    if bounds is None:
      return 0.0
    upper = float(np.asarray(bounds.upper))
    return min(math.inf if math.isnan(upper) else upper, self._pure_epsilon())

  def get_delta(self, target_epsilon: float) -> float:
    """The certified upper delta at ``target_epsilon``: 1 after a step without privacy, 0
    before any step or at or beyond the pure-DP bound."""
    if self._non_private:
      return 1.0
    if self.composition() is None or target_epsilon >= self._pure_epsilon():
      return 0.0
    bounds = self.delta_bounds(target_epsilon)
    upper = float(np.asarray(bounds.upper))
    return 1.0 if math.isnan(upper) else min(upper, 1.0)
