"""Calibration: the noise multiplier, sampling rate or number of steps that spends a privacy budget.

For a target epsilon at a delta (or a target delta at an epsilon), each front door finds the
DP-SGD parameter at which the accountant's *certified upper bound* meets the target:

* ``noise_multiplier``: the smallest sigma with upper <= target (the upper falls as sigma grows);
* ``sampling_rate``: the largest q with upper <= target;
* ``steps``: the largest whole number of steps with upper <= target.

Method. The residual is log(upper / target), close to linear in log sigma (log q, log T). The
search grows a bracket from a start, its first step sized by the first value and the least
slope ``_ELASTICITY`` (for an epsilon target), and shrinks it by the Pegasus secant
(``_solver.bracket_search``: values only, since a slope costs about as much as another
certified value). On concrete inputs it runs on the host, each read one call of a compiled
accountant (one PLD setting with an epsilon target, but against groups, reads the front door
itself: its own plan at each value, so the answer is exact against it and nearby values share
one program), or, for a PLD batch, as one compiled loop in which each setting stops on
its own; under a caller's jit/vmap/grad it is one compiled loop. The value returned
is the bracket end at which the upper bound was *evaluated* on the target's safe side, aimed at
``(1 - margin)`` times the target so that the front door's own plan (which may differ a little
from the calibration's) also stays below it; on the host the answer is then checked by the
front door itself. The root is differentiated by the implicit-function theorem
(``_solver.implicit_root``): d sigma / d target, d sigma / d q, ... (the PLD accountant composes
whole steps, so with it d / d steps raises; the saddle-point and RDP accountants take real
counts).

Start. On concrete inputs, but for a PLD batch (``_host_starts``): between the central-limit
(GDP) guess of Bu et al. (2020), optimistic, and RDP's calibrated value, conservative, at their
geometric mean (usually within a few percent of the PLD answer; RDP is one small program). A
PLD batch, and under tracing: the saddle-point accountant's estimate calibrated the same way,
from the central-limit guess, where it is one (a value the saddle point flags as out of its
range or vacuous, or more than 10x from the guess, is no estimate: at delta 1e-12 it can be
1e-4 of the answer).

Plans. The PLD accountant needs an accuracy plan that serves every value the search visits. With
concrete inputs it is made here, one per setting, for a window around the start (reaching from
the central-limit guess to RDP's value, at most 15% from the start; for a batch 15% to the safe
side, 5% to the other), and remade when the answer lies at the window's edge (where one setting
reads the front door, the window only bounds its reads): the next window reaches past that edge
towards larger epsilon as far as the certified upper there says the target may lie (epsilon
falls at least as fast as 1 / sigma, 1 / q and 1 / sqrt(T)), never around the old one (a
window of a wide range of sigma takes the finest grid of its largest sigma and the loss range
of its smallest: the plan would grow without bound). Each search reads only the values its
plan serves; where every one of them reads above the target, the next window lies past the
window's other edge, as far as the slope of log epsilon measured there says. Each plan's size
is estimated on the host before anything is computed: a window whose plan exceeds
``MAX_PLAN_POINTS`` is narrowed towards where the answer may lie furthest, and where even one
value needs more (at the start and at the central-limit guess), the calibration is refused
with the reason and what is reachable (a coarser ``eps_error``, and those of the constant-time
"rdp" and "spa" accountants that give a finite bound there).

Time. The searches of one setting read at most ``MAX_WORK_POINTS`` grid points in all (each
round charged its plan's points times the values it read, and a compilation; a round may read
no more than is left), so a calibration answers within a bound of the plan work, or refuses
with the same kind of message when that budget runs out.
Under ``jit``/``vmap``/``grad`` pass ``plan=`` (from ``calibrate.make_plan``), as for
``jaxacct.epsilon``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxacct import cgf as _cgf
from jaxacct import gdp as _gdp
from jaxacct import rdp as _rdp
from jaxacct import results
from jaxacct import spa as _spa
from jaxacct._inputs import (check_choice, check_delta, check_epsilon, check_range,
                             check_unused, check_whole)
from jaxacct._numerics import array_namespace, fast_jit, float64, is_traced, scoped_gradients
from jaxacct._solver import bracket_search, furthest_holding, implicit_root, largest_whole
from jaxacct.api import RELATIONS, _dpsgd_model, dpsgd_delta, dpsgd_epsilon
from jaxacct.composition import Composition, checked
from jaxacct.group import GroupSteps, check_fixed_batch, check_group_size, group_sampling
from jaxacct.pld import accountant as _pld
from jaxacct.pld import host as _pld_host
from jaxacct.pld import make_plan as _pld_plan
from jaxacct.pld.plan import SizeCache as _SizeCache
from jaxacct.pld.plan import group_plans as _pld_group_plans
from jaxacct.pld.plan import plan_points
from jaxacct.pld.plan import stack_plans as _pld_stack
from jaxacct.pld.spectrum import integer_count

UNKNOWNS = ("noise_multiplier", "sampling_rate", "steps")
"""The DP-SGD parameters a calibration solves for."""
TARGETS = ("epsilon", "delta")
"""The budgets a calibration meets (``target=``): an epsilon at a delta, or a delta at an
epsilon."""
ACCOUNTANTS = ("pld", "spa", "rdp")  # the accountants that certify an upper bound
"""The accountants a calibration takes: those that certify an upper bound."""
# The range searched for each unknown (a bracket is grown from the guess within it).
DOMAIN = {"noise_multiplier": (1e-3, 1e6), "sampling_rate": (1e-12, 1.0),
          "steps": (1.0, 1e7)}
"""The range searched for each unknown."""
# The PLD upper at the answer is aimed this far below the target (relative): two plans' uppers
# differ by less (the front door's re-aim is the safety net where they do not). The
# constant-time accountants compute the same function at the front door: only round-off.
_PLD_MARGIN = {"epsilon": 2e-4, "delta": 1e-3}
_EXACT_MARGIN = 1e-9
_MAX_MARGIN = 0.5  # a re-aimed search aims at least this fraction of the target
_TOL = 1e-9        # relative width of the final bracket of sigma or q
_FTOL = 0.05       # ... or the safe end's upper within this fraction of the margin below the aim
_SEARCH = 60       # evaluations budget of one secant search
_SPREAD = 1.15     # the PLD plan serves the start's value within this factor either side
_NEAR = 1.05       # a moved window keeps this much room on the answer's safe side ...
_REACH = 1.32      # ... and reaches at least this factor past it
# How fast the certified epsilon at least falls (in log-log) as the unknown moves to its safe
# side: ~1 / sigma and ~1 / q where epsilon is small (mu-GDP, epsilon ~ mu), faster elsewhere;
# ~1 / sqrt(T) (the central limit). A moved window reaches as far as these slopes allow.
_ELASTICITY = {"noise_multiplier": 1.0, "sampling_rate": 1.0, "steps": 0.5}
_ROUNDS = 6        # searches (each on one plan) before a calibration gives up
# The largest accuracy plan a PLD calibration computes on, in grid points (``plan_points``):
# ~1.8 s per certified value at this size on one busy CPU core (the XLA CPU program uses one).
MAX_PLAN_POINTS = 2**25
"""The largest accuracy plan a PLD calibration computes on, in grid points (``plan_points``);
a calibration that needs a larger one is refused, naming the ``eps_error`` that would fit."""
# The work of one setting's searches, in grid points read (plan points x evaluations, summed
# over rounds, a compilation counted as ``_COMPILE_POINTS``): ~30 s on one busy core, so with
# the start, the compilations and the front door's check a calibration answers or refuses
# within a minute on 2 cores. A round may read ``_SEARCH`` values, fewer where the budget left
# allows fewer, and is refused below ``_MIN_EVALUATIONS`` (a search from a start in its window
# reads ~8-15).
MAX_WORK_POINTS = 16 * MAX_PLAN_POINTS
"""The grid points one setting's searches may read in all (about 30 s of CPU); a calibration
answers within it or refuses."""
_COMPILE_POINTS = 10**8
_MIN_EVALUATIONS = 16
_EPS_ERROR = 0.01  # the PLD accountant's default eps_error (its margin above scales with it)
_STEP = 0.01       # the certified search's first step from its start, in log x (then doubling)
# The saddle-point start stops once its estimate is within this of the target (in log): the
# certified search reads from there, and a start closer than its ~0.3% from the answer buys
# nothing (a PLD batch of 100 settings: 5 reads each instead of up to 10, half the start's time).
_START_FTOL = 1e-5
# The host's start (``_host_pld_start``) aims this fraction of the search's band (``_FTOL`` x
# margin) below the search's aim, to within ``_HOST_FTOL`` of it, in at most ``_HOST_SEARCH``
# values: its upper then lands in the band where the host's estimate errs by < ~0.3 of it.
_HOST_AIM = 0.5
_HOST_FTOL = 0.2
_HOST_SEARCH = 16
_HOST_REACH = 4.0
_SHARED_PLAN_FAILED = results.WINDOW_TOO_SMALL | results.BELOW_FLOOR
# A saddle-point start with these bits, or beyond this factor of the central-limit guess, is no
# estimate (the saddle point lies beyond its searched tilts): the guess is used instead.
_NO_ESTIMATE = results.OUT_OF_RANGE | results.UPPER_VACUOUS | results.APPROXIMATION
_START_RATIO = 10.0


# ----------------------------------------------------------------------------------------------
# One certified upper bound per setting (the accountants' pure single-setting functions)


def _single(accountant, target):
  """fn(composition, x, plan) -> Bounds of one setting: the upper bound of ``target`` (epsilon
  at delta = x, or delta at epsilon = x) by ``accountant``, traceable and differentiable."""
  if accountant == "pld":
    return _pld._epsilon_single if target == "epsilon" else _pld._delta_single
  if accountant == "spa":
    fn = _spa._epsilon_direction if target == "epsilon" else _spa._delta_direction
    return lambda comp, x, plan: _cgf._worst_direction(comp, fn, x, "clt")
  fn = _rdp._epsilon_single if target == "epsilon" else _rdp._delta_single
  return lambda comp, x, plan: fn(comp, x)


def _composition(sigma, q, steps, relation, full_batch):
  """DP-SGD's composition from (possibly traced) parameters, with the front door's model (a
  ``group.GroupSteps`` relation: against groups)."""
  if isinstance(relation, GroupSteps):
    return relation.composition(sigma, q, steps)
  return Composition.of((_dpsgd_model(sigma, q, relation, full_batch), steps))


# ----------------------------------------------------------------------------------------------
# The traced core: one setting


def _guess(unknown, target, other, sigma, q, steps, relation, target_kind):
  """A starting value from the central-limit mu (Bu et al. 2020): mu = q sqrt(T (e^{1/s^2} - 1))
  with s = sigma (add/remove) or sigma / 2 (replace-one); for a delta target, mu from delta's
  curve at epsilon. Only a start: the bracket search does not depend on its accuracy. On host
  arrays it runs on the host (``gdp.host_mu``: nothing compiled), else in JAX."""
  xp = array_namespace(target, other, sigma, q, steps)
  epsilon, delta = (target, other) if target_kind == "epsilon" else (other, target)
  mu = _gdp.host_mu(epsilon, delta) if xp is np else _gdp._mu_impl(epsilon, delta)
  mu = xp.where(xp.isfinite(mu) & (mu > 0.0), mu, 1.0)
  scale = (relation.scale if isinstance(relation, GroupSteps)
           else 2.0 if relation == "replace_one" else 1.0)
  lo, hi = DOMAIN[unknown]
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    if unknown == "noise_multiplier":
      guess = scale / xp.sqrt(xp.log1p(mu * mu / (q * q * steps)))
    elif unknown == "sampling_rate":
      guess = mu / xp.sqrt(steps * xp.expm1((scale / sigma) ** 2))
    else:
      guess = xp.round(mu * mu / (q * q * xp.expm1((scale / sigma) ** 2)))
  return xp.clip(xp.where(xp.isfinite(guess), guess, 1.0), lo, hi)


def _first_slope(unknown, target_kind):
  """The least slope of the residual log(upper / aim) in log x that a search's first step (the
  certified search's, and the saddle-point start's) is sized by (``bracket_search``'s
  ``slope``): ``_ELASTICITY`` for an epsilon target (the step then reaches the root or past it:
  a one-step bracket where the start is close); None for a delta target, whose log falls many
  times faster (that step would overshoot far), which keeps the fixed first step."""
  return _ELASTICITY[unknown] if target_kind == "epsilon" else None


def _core(unknown, accountant, target_kind, relation, full_batch, field, step, margin, target,
          other, sigma, q, steps, start, plan, iters=_SEARCH, bounds=None):
  """The calibrated value of one setting (implicit gradients) and (whether the search found a
  sign change, the bounds at the value, the status at the other end of the final bracket, that
  end, the values it read). The search reads ``field`` of the accountant's bounds ("upper";
  "estimate" for a starting value), grows its bracket from ``start`` by steps of ``step`` in log
  x, doubling, and reads at most ``iters`` values (may be traced: one program serves every
  budget), within ``bounds`` (low, high: the values a plan serves; default ``DOMAIN``)."""
  single = _single(accountant, target_kind)
  aim = jnp.log(target) + jnp.log1p(-margin)
  whole_steps = accountant == "pld" and unknown != "steps"
  if whole_steps:  # d / d steps raises here (the PLD accountant composes whole steps)
    steps = integer_count(steps)
  known = {"noise_multiplier": sigma, "sampling_rate": q, "steps": steps}

  def bounds_at(value):
    args = dict(known, **{unknown: value})
    if whole_steps:  # (the implicit gradient differentiates the residual in every value it
      # closes over, with explicit zeros: the count enters it as a constant)
      args["steps"] = jax.lax.stop_gradient(args["steps"])
    comp = _composition(args["noise_multiplier"], args["sampling_rate"], args["steps"],
                        relation, full_batch)
    return single(comp, other, plan)

  # Decreasing residuals: the upper falls with sigma and rises with q and T. The safe end (where
  # the upper was seen below the aim) is then b for sigma, a for q and T.
  sign = 1.0 if unknown == "noise_multiplier" else -1.0

  def evaluate(x):
    bounds = bounds_at(x)
    value = getattr(bounds, field)
    value = jnp.where(jnp.isnan(value), jnp.inf, value)  # no bound is never below the target
    return sign * (jnp.log(value) - aim), bounds

  evaluate = jax.jit(evaluate)  # traced once for the search and the implicit root's residual
  lo, hi = DOMAIN[unknown] if bounds is None else bounds
  start = jax.lax.stop_gradient(start)

  def solve(_, __):
    a, b, at_a, at_b, found, reads = bracket_search(
        evaluate, start, step=step, lower=lo, upper=hi, iters=iters, tol=_TOL,
        whole=unknown == "steps", ftol=_FTOL * margin if field == "upper" else _START_FTOL,
        safe_end="b" if sign > 0 else "a",
        count=True, slope=_first_slope(unknown, target_kind))
    value, at, far, far_at = (b, at_b, a, at_a) if sign > 0 else (a, at_a, b, at_b)
    # (as floats: custom_root gives its aux float tangents)
    floats = dataclasses.replace(at, status=at.status.astype(jnp.float64))
    return value, (found.astype(jnp.float64), floats, far_at.status.astype(jnp.float64), far,
                   reads.astype(jnp.float64))

  if unknown == "steps" or field != "upper":  # a whole number, or a start: no gradient
    value, aux = solve(None, None)
  else:
    value, aux = implicit_root(lambda x: evaluate(x)[0], solve, start, has_aux=True)
  found, at, far_status, far, reads = aux
  return value, (found > 0.0, dataclasses.replace(at, status=at.status.astype(jnp.int32)),
                 far_status.astype(jnp.int32), far, reads)


def _start(unknown, target_kind, relation, full_batch, target, other, sigma, q, steps):
  """(where the certified search starts, the central-limit guess): the saddle-point
  accountant's estimate calibrated the same way (constant time; usually within 1e-3), from the
  central-limit guess; that guess itself where the saddle point finds nothing, or nothing it
  estimates (``_NO_ESTIMATE`` at its value, or beyond ``_START_RATIO`` of the guess: at delta
  1e-12 and sigma 0.78 its rate was 6.9e-8 for an answer of 1e-4, the guess 7.5e-4). No
  gradient flows: the inputs are constants to it, so a caller's grad does not linearise its
  searches only to discard their tangents."""
  target, other, sigma, q, steps = jax.lax.stop_gradient((target, other, sigma, q, steps))
  clt = _guess(unknown, target, other, sigma, q, steps, relation, target_kind)
  value, (found, at, _, _, _) = _core(unknown, "spa", target_kind, relation, full_batch, "estimate",
                                   0.25, 0.0, target, other, sigma, q, steps, clt, None)
  lo, hi = DOMAIN[unknown]
  near = jnp.abs(jnp.log(value / clt)) <= jnp.log(_START_RATIO)
  good = (found & jnp.isfinite(value) & (value >= lo) & (value <= hi) & near
          & (at.status & _NO_ESTIMATE == 0))
  return jnp.where(good, value, clt), clt


def _runner(unknown, accountant, target_kind, relation, full_batch, given_start):
  """The certified search as one program over a flat batch (leaves [settings]), with implicit
  gradients: under a caller's jit/vmap/grad with the start (``_start``) computed inside, or a
  PLD batch on concrete inputs from the starts ``given_start`` (each setting's search stops on
  its own; a host loop would read every setting until the last one stops)."""

  def one(margin, target, other, sigma, q, steps, start, plan, low, high, iters):
    if not given_start:
      start = _start(unknown, target_kind, relation, full_batch, target, other, sigma, q,
                     steps)[0]
    return _core(unknown, accountant, target_kind, relation, full_batch, "upper", _STEP, margin,
                 target, other, sigma, q, steps, start, plan, iters, (low, high))

  def run(margin, target, other, sigma, q, steps, start, plan, low, high, iters=_SEARCH):
    # (a plan's leaves: one per setting, or one for all; [low, high]: where each search may
    # read; ``iters``: a float64 scalar, the evaluations each search may read; ``start``: None
    # where computed inside)
    plans = jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, margin.shape), plan)
    args = (margin, target, other, sigma, q, steps, start, plans, low, high)
    return jax.lax.map(lambda a: one(*a, iters), args, batch_size=_map_chunk(accountant))

  return fast_jit(scoped_gradients(run))


def _map_chunk(accountant):
  """Settings per vectorised chunk of a compiled batch: one at a time for the PLD accountant on
  CPU (see ``jaxacct.pld.accountant``), else 64."""
  return None if (accountant == "pld" and jax.default_backend() == "cpu") else 64


def _reader(accountant, target_kind, relation, full_batch):
  """The certified bounds of a flat batch of settings (each on its own plan, leaves [settings],
  or one plan broadcast; None for the constant-time accountants): the host search's reads."""
  single = _single(accountant, target_kind)

  def run(other, sigma, q, steps, plan):
    plans = jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, other.shape), plan)
    one = lambda a: single(_composition(*a[1:4], relation, full_batch), a[0], a[4])
    return jax.lax.map(one, (other, sigma, q, steps, plans), batch_size=_map_chunk(accountant))

  return fast_jit(run, exported=f"calibrate.read.{accountant}.{target_kind}.{relation!r}."
                               f"{full_batch}")


def _starter(unknown, target_kind, relation, full_batch):
  """``_start`` compiled over a flat batch: (starts, central-limit guesses)."""

  def run(target, other, sigma, q, steps):
    one = lambda *a: _start(unknown, target_kind, relation, full_batch, *a)
    return jax.vmap(one)(target, other, sigma, q, steps)

  return fast_jit(run)


_RUNNERS = {}


_BUILDERS = {"search": _runner, "start": _starter, "read": _reader}


def _compiled(kind, *key):
  """The compiled program of ``kind`` (``_BUILDERS``) for these static options."""
  if (kind, key) not in _RUNNERS:
    _RUNNERS[kind, key] = _BUILDERS[kind](*key)
  return _RUNNERS[kind, key]


# ----------------------------------------------------------------------------------------------
# Front doors: checks and options


def _plan_error(eps_error):
  """The PLD plans' eps_error: the user's, or the accountant's default."""
  return _EPS_ERROR if eps_error is None else float(eps_error)


def _coarseness(eps_error):
  """How much coarser than the default the PLD plan is (>= 1): the aim's margin scales with it."""
  return max(1.0, _plan_error(eps_error) / _EPS_ERROR)


def _check(unknown, target, accountant, relation, target_value, other, known, eps_error=None):
  check_choice("unknown", unknown, UNKNOWNS)
  check_choice("target", target, TARGETS)
  check_choice("accountant (a calibration needs a certified upper bound)", accountant,
               ACCOUNTANTS)
  if not isinstance(relation, GroupSteps):
    check_choice("relation", relation, RELATIONS)
  check_argument("eps_error", eps_error, accountant=accountant)
  if target == "epsilon":
    check_argument("epsilon", target_value)
    check_delta(other)
  else:
    check_argument("delta", target_value)
    check_epsilon(other)
  for name, value in known.items():
    check_argument(name, value)


# What each calibration argument must be: (low, high, low_open, high_open, whole).
_ARGUMENTS = {"epsilon": (0.0, np.inf, True, True, False),
              "noise_multiplier": (0.0, np.inf, True, True, False),
              "sampling_rate": (0.0, 1.0, True, False, False),
              "steps": (1.0, np.inf, False, True, True),
              "eps_error": (0.0, 1.0, True, False, False),
              "group_size": (1.0, np.inf, False, True, True),
              "batch_size": (1.0, np.inf, False, True, True),
              "dataset_size": (1.0, np.inf, False, True, True)}


def check_argument(name, value, *, accountant="pld"):
  """Raises ``ValueError`` naming ``name`` unless ``value`` is a valid (concrete) value of that
  argument of a calibration: "epsilon", "delta", "noise_multiplier", "sampling_rate", "steps",
  "eps_error" (None passes; only the "pld" ``accountant`` takes one), "group_size",
  "batch_size", "dataset_size" (whole numbers >= 1). What the command line checks its options
  with before anything is computed; traced values pass."""
  if name == "delta":
    check_delta(value)
    return
  check_choice("argument", name, tuple(_ARGUMENTS) + ("delta",))
  if name == "eps_error":
    if accountant != "pld":
      check_unused(accountant, eps_error=value)
    if value is None:
      return
  low, high, low_open, high_open, whole = _ARGUMENTS[name]
  check_range(name, value, low, high, low_open=low_open, high_open=high_open)
  if whole:
    check_whole(name, value)


@dataclasses.dataclass(frozen=True)
class Options:
  """The static choices of one calibration, read by every stage: what is solved for
  (``unknown``), the ``target`` ("epsilon" or "delta"), the ``accountant``, the ``relation`` (a
  name, or a ``group.GroupSteps``), whether the batch is full (q = 1: the Gaussian's model) and
  the user's ``eps_error`` (None: the default; the front door reads the same)."""

  unknown: str
  target: str
  accountant: str
  relation: object
  full_batch: bool
  eps_error: float | None = None

  @property
  def plan_error(self) -> float:
    """The PLD plans' eps_error."""
    return _plan_error(self.eps_error)

  @property
  def atoms(self) -> int:
    """Components of one step's loss model: 2 for the subsampled Gaussian, k + 1 for a group."""
    return self.relation.group_size + 1 if isinstance(self.relation, GroupSteps) else 2

  @property
  def key(self):
    """The static key of the compiled search."""
    return (self.unknown, self.accountant, self.target, self.relation, self.full_batch)


def _options(unknown, target, accountant, relation, known, eps_error):
  """The ``Options`` of a call (a full batch: every concrete rate 1, against single examples)."""
  q = known.get("sampling_rate")
  full_batch = (q is not None and not is_traced(q) and bool(np.all(np.asarray(q) == 1.0))
                and not isinstance(relation, GroupSteps))
  return Options(unknown, target, accountant, relation, full_batch, eps_error)


def _margin(opts, target_value, gap=None):
  """How far below the target the upper is aimed (relative): ``_PLD_MARGIN`` for the PLD
  accountant, scaled with a coarser eps_error (relative at every epsilon: an absolute 2e-4 aimed
  epsilon 1e-3 at 8e-4 and gave a sigma 25% too large), round-off for the others; at most
  ``gap`` (absolute: ``get_noise_multiplier``'s tolerance)."""
  xp = array_namespace(target_value)  # (host values stay on the host: nothing compiled)
  target_value = xp.asarray(target_value, xp.float64)
  margin = (_PLD_MARGIN[opts.target] * _coarseness(opts.eps_error) if opts.accountant == "pld"
            else _EXACT_MARGIN)
  margin = xp.full(xp.shape(target_value), margin)
  return margin if gap is None else xp.minimum(margin, gap / target_value)


def _settings(unknown, known, target_value, other, margin):
  """(margin, target, other, sigma, q, steps) broadcast and flattened (the unknown's slot: 1)."""
  full = [margin, target_value, other] + [known.get(name, 1.0) for name in UNKNOWNS]
  xp = array_namespace(*full)  # (host values stay on the host: nothing compiled)
  arrays = xp.broadcast_arrays(*[xp.asarray(a, xp.float64) for a in full])
  return arrays[0].shape, tuple(xp.ravel(a) for a in arrays)


def _rows(flat):
  """The settings of a flat batch as rows [target, other, sigma, q, steps] (host values)."""
  return np.stack([np.asarray(a) for a in flat[1:]], axis=-1)


def _one(flat, index):
  """One setting of a flat batch as a flat batch of one."""
  return tuple(np.asarray(a)[index:index + 1] for a in flat)


def _starts(opts, flat):
  """(``_start``, the central-limit guess) of every setting of a flat batch (host values)."""
  start, clt = _compiled("start", opts.unknown, opts.target, opts.relation,
                         opts.full_batch)(*flat[1:])
  return np.asarray(start), np.asarray(clt)


# ----------------------------------------------------------------------------------------------
# Plans of bounded size


@dataclasses.dataclass(frozen=True)
class Window:
  """The plan a round's search runs on and, per setting, the range [low, high] of the unknown
  it was made to serve (None for a caller's plan)."""

  plan: object
  low: np.ndarray | None = None
  high: np.ndarray | None = None


def _window_composition(opts, rows, low, high):
  """(the composition of every row of ``rows`` ([target, other, sigma, q, steps] each) at both
  ends of its [low, high] (settings: each row's low end, then each row's high end), the
  smallest delta the search reads for each)."""
  target_value, other, sigma, q, steps = np.reshape(rows, (-1, 5)).T
  lo, hi = DOMAIN[opts.unknown]
  ends = np.clip(np.concatenate([np.broadcast_to(low, sigma.shape),
                                 np.broadcast_to(high, sigma.shape)]), lo, hi)
  known = {"noise_multiplier": np.tile(sigma, 2), "sampling_rate": np.tile(q, 2),
           "steps": np.tile(steps, 2)}
  known[opts.unknown] = np.round(ends) if opts.unknown == "steps" else ends
  comp = _composition(known["noise_multiplier"], known["sampling_rate"], known["steps"],
                      opts.relation, opts.full_batch)
  smallest = other if opts.target == "epsilon" else 0.1 * target_value
  return comp, np.tile(smallest, 2)


def _setting_plan(opts, rows, low, high, eps_error, size_cache=None):
  """One plan serving the unknown over [low, high] for every row of ``rows`` ([target, other,
  sigma, q, steps] each), down to the smallest delta the search reads."""
  comp, smallest = _window_composition(opts, rows, low, high)
  return _pld_plan(comp, smallest, eps_error=eps_error, size_cache=size_cache)


def _window_plans(opts, rows, low, high):
  """``_plan_or_none`` of each row over its own [low, high] (the call's eps_error), its models
  evaluated once for all rows (``pld.plan.group_plans``): None where the planner refuses a
  row; any other error propagates."""
  comp, smallest = _window_composition(opts, rows, low, high)
  count = np.shape(smallest)[0] // 2
  plans = _pld_group_plans(checked(comp, integer_counts=True), smallest,
                           [np.array([i, i + count]) for i in range(count)], opts.plan_error)
  for plan in plans:
    if isinstance(plan, ValueError) and not _refused(plan):
      raise plan
  return [None if isinstance(plan, ValueError) else plan for plan in plans]


def _plan_for(opts, flat, centre, spread, size_cache):
  """One PLD plan serving the search of every setting of a flat batch within a factor
  ``spread`` of its ``centre`` (``make_plan``: one grid for the whole batch)."""
  centre = np.asarray(centre)
  return _setting_plan(opts, _rows(flat), centre / spread, centre * spread, opts.plan_error,
                       size_cache)


# The planner's refusals (``pld.plan.make_plan``): a loss span beyond float64, an FFT beyond 2^26.
_PLANNER_REFUSALS = ("the composed privacy loss spans", "the plan needs an FFT of")


def _refused(error):
  """Whether a ValueError is one of the planner's refusals (``_PLANNER_REFUSALS``)."""
  return str(error).startswith(_PLANNER_REFUSALS)


def _plan_or_none(opts, row, low, high, eps_error=None, size_cache=None):
  """``_setting_plan`` of one setting (at ``eps_error``, default the call's), or None where the
  planner refuses it; any other error propagates."""
  eps_error = opts.plan_error if eps_error is None else eps_error
  try:
    return _setting_plan(opts, row, np.array([low]), np.array([high]), eps_error, size_cache)
  except ValueError as err:
    if _refused(err):
      return None
    raise


def _points(plan, opts):
  """``plan_points`` of a plan (+inf for none)."""
  return np.inf if plan is None else plan_points(plan, opts.atoms)


def _fits(plan, opts, limit=MAX_PLAN_POINTS):
  """Whether a plan exists and is within ``limit`` grid points."""
  return _points(plan, opts) <= limit


def _furthest_fitting(opts, row, far, near):
  """The point of [near, far] (in log x) nearest ``far`` whose plan alone fits (to ~1.5% of the
  log span), or None where ``near``'s does not either."""
  fits = lambda x: _fits(_plan_or_none(opts, row, x, x), opts)
  if fits(far):
    return far
  if near is None or not fits(near):
    return None
  return furthest_holding(fits, near, far, geometric=True)


def _fitted_plan(opts, row, low, high, anchor, fallback, cache, whole):
  """One setting's plan over [low, high], narrowed in log x towards ``anchor`` (where its answer
  may lie furthest) until it fits ``MAX_PLAN_POINTS``; where ``anchor`` alone does not fit, the
  anchor moves towards ``fallback`` as far as fits. (plan, low, high), plan None where no anchor
  fits. The windows are sized without the cache (a size the cache offers may be 2x larger, and
  a window that does not fit must leave no sizes there); the plan kept takes the cache's sizes
  where those fit too (``_cached_plan``). ``whole``: its plan over [low, high]
  (``_window_plans``; None where refused)."""
  if _fits(whole, opts):  # (the usual case: the whole window fits, and so its anchor)
    return _cached_plan(opts, row, low, high, cache, whole), low, high
  anchor = _furthest_fitting(opts, row, anchor, fallback)
  if anchor is None:
    return None, low, high
  ends = lambda t: (anchor * (low / anchor) ** t, anchor * (high / anchor) ** t)
  fits = lambda t: _fits(_plan_or_none(opts, row, *ends(t)), opts)
  # (the window kept to within ~1.5% of the largest that fits, in log x)
  low, high = ends(1.0 if fits(1.0) else furthest_holding(fits, 0.0, 1.0))
  return _cached_plan(opts, row, low, high, cache), low, high


def _cached_plan(opts, row, low, high, cache, own=None):
  """The plan over [low, high] on sizes the cache offers (another round's compiled program)
  where those fit ``MAX_PLAN_POINTS``, else on its own sizes (which fit; ``own``: that plan,
  where made already)."""
  if cache is not None:
    plan = _plan_or_none(opts, row, low, high, size_cache=cache)
    if _fits(plan, opts):
      return plan
  return _plan_or_none(opts, row, low, high) if own is None else own


def _own_plan(opts, flat, low, high, anchor, fallback, cache):
  """Each setting planned apart over its window (``_fitted_plan``) and the plans stacked (leaves
  [settings]: a batch of diverse settings costs its largest, not the union of all): (Window,
  the indices of the settings no plan serves; the Window None where there are any)."""
  rows = _rows(flat)
  fallback = np.full(rows.shape[0], np.nan) if fallback is None else fallback
  keys = np.concatenate([rows, np.stack([low, high, anchor, fallback], axis=-1)], axis=-1)
  unique, index = np.unique(keys, axis=0, return_inverse=True)
  index = np.ravel(index)
  # (a batch's plans are stacked onto its largest sizes: a cache, for the rounds of one
  # setting, would only cost each setting a second plan)
  cache = cache if len(unique) == 1 else None
  wholes = _window_plans(opts, unique[:, :5], unique[:, 5], unique[:, 6])
  fitted = [_fitted_plan(opts, key[:5], *key[5:8], None if np.isnan(key[8]) else key[8], cache,
                         whole) for key, whole in zip(unique, wholes)]
  missing = [j for j, (plan, _, _) in enumerate(fitted) if plan is None]
  if missing:
    return None, [int(i) for i in np.flatnonzero(np.isin(index, missing))]
  plans = [fitted[j][0] for j in index]
  plan = plans[0] if len(plans) == 1 else _pld_stack(plans)
  return Window(plan, np.array([fitted[j][1] for j in index]),
                np.array([fitted[j][2] for j in index])), []


def _first_window(opts, flat, starts, cache):
  """(the first round's Window, its starts) from ``_host_starts``' (start, low, high, clt):
  each setting's window over [low, high]. Where a start's plan does not fit even alone, the
  central-limit guess's window is tried before refusing (a start may lie far on the costly
  side)."""
  start, low, high, clt = starts
  window, missing = _own_plan(opts, flat, low, high, start, None, cache)
  if not missing:
    return window, start
  moved = start.copy()
  moved[missing] = clt[missing]
  if np.any(moved != start):
    low, high = np.where(moved != start, moved / _SPREAD, low), np.where(moved != start,
                                                                           moved * _SPREAD, high)
    window, still = _own_plan(opts, flat, low, high, moved, None, cache)
    if not still:
      return window, moved
  raise _too_large(opts, flat, missing[0], float(start[missing[0]]))


def _host_starts(opts, flat):
  """(start, low, high, central-limit guess) of each setting's first search on concrete inputs.

  The central-limit guess (``_guess``) is optimistic: below the PLD answer's sigma, above its q
  and T (by 1-25% in sigma, up to 20x in T for few steps). For the PLD accountant the RDP
  calibration lies on the other side, 5-30% safer (``_rdp_start``: for add/remove DP-SGD on
  the host at integer orders, nothing compiled): the search starts at their geometric mean
  (usually within a few percent) and its first window reaches from one to the other
  (``_NEAR`` beyond each, at most ``_SPREAD`` from the start). Where RDP finds nothing, the
  guess with ``_SPREAD`` either side.
  A PLD batch starts from the saddle-point accountant's estimate (``_starts``: one compiled
  program), within ~0.3% where this start is within ~1%: a setting's search in a batch then
  reads one PLD value less, worth the start's compilation. Its window reaches ``_SPREAD`` to
  the safe side and ``_NEAR`` to the other: the certified upper lies above the estimate (and
  the central-limit guess, where it is the start, is optimistic), so the answer lies on the
  safe side, and the other end, the costly one, sizes the plan (epsilon 1...4: 1.4x fewer grid
  points than ``_SPREAD`` either side). One PLD setting that reads the front door starts where
  the PLD composed on the host puts the answer (``_host_pld_start``; replace-one, whose RDP
  start would compile the RDP accountant, looks for it from the central-limit guess first)."""
  if opts.accountant == "pld" and np.size(flat[1]) > 1:
    start, clt = _starts(opts, flat)
    if opts.unknown == "noise_multiplier":  # (the safe side: larger sigma, smaller q and T)
      return start, start / _NEAR, start * _SPREAD, clt
    return start, start / _SPREAD, start * _NEAR, clt
  clt = _guess(opts.unknown, *(np.asarray(a, np.float64) for a in flat[1:]), opts.relation,
               opts.target)
  start, low, high = clt, clt / _SPREAD, clt * _SPREAD
  front_door = _reads_front_door(opts, clt)
  if front_door and opts.relation != "add_remove":  # (its RDP start would compile a program)
    found = _host_pld_start(opts, flat, clt, low, high)
    if found is not None:
      return found + (clt,)
  if opts.accountant == "pld":
    rdp = _rdp_start(opts, flat, clt)
    ok = np.isfinite(rdp) & (rdp > 0.0)
    middle = np.sqrt(clt * np.where(ok, rdp, clt))
    if opts.unknown == "steps":
      middle = np.round(middle)
    start = np.where(ok, middle, clt)
    low = np.where(ok, np.maximum(start / _SPREAD, np.minimum(clt, rdp) / _NEAR), low)
    high = np.where(ok, np.minimum(start * _SPREAD, np.maximum(clt, rdp) * _NEAR), high)
    if front_door:
      start, low, high = _host_pld_start(opts, flat, start, low, high) or (start, low, high)
  return start, low, high, clt


def _host_pld_start(opts, flat, start, low, high):
  """(start, low, high) with ``start`` moved to where the PLD accountant's own discretisation,
  composed on the host (``pld.host``: nothing compiled), puts the answer, aimed inside the
  certified search's band (its upper there lies within ~1e-5 relative of the certified one,
  up to ~1e-2 at q ~1e-4 and a few steps: then the search reads more values): the search's
  reads then lie within ~1e-5 of each other, on one plan size, where from
  ``start`` (1-4 % off) they straddled two or three sizes, each a compiled program, in 17 of
  25 random settings. The host may look ``_HOST_REACH`` beyond ``start`` (its reads compile
  nothing); an answer outside the window [``low``, ``high``] (within ``_NEAR``) moves the
  window there, ``_SPREAD`` either side. None where the host cannot serve a plan
  (``pld.host.HOST_POINTS``) or finds no answer."""
  margin, target, other, sigma, q, steps = (np.asarray(a, np.float64) for a in flat)
  aim = np.log(target) + np.log1p(-margin * (1.0 + _HOST_AIM * _FTOL))
  sign = 1.0 if opts.unknown == "noise_multiplier" else -1.0
  eps_error = _EPS_ERROR if opts.eps_error is None else opts.eps_error
  whole = opts.unknown == "steps"
  snap = np.round if whole else (lambda x: x)
  lo, hi = DOMAIN[opts.unknown]
  reach = (snap(np.maximum(start / _HOST_REACH, lo)), snap(np.minimum(start * _HOST_REACH, hi)))
  directions = []  # (after the first value: the direction that gave it, alone)

  def evaluate(x):
    known = {"noise_multiplier": sigma, "sampling_rate": q, "steps": np.round(steps),
             opts.unknown: snap(x)}
    comp = _composition(*(np.float64(known[name][0]) for name in UNKNOWNS), opts.relation,
                        opts.full_batch)
    plan = _pld_plan(comp, other[0], eps_error=eps_error)
    if not _fits(plan, opts):  # (the calibration would refuse it: no use estimating there)
      raise ValueError("past MAX_PLAN_POINTS")
    epsilon, add = _pld_host.epsilon(comp, other[0], plan, directions or None)
    directions[:] = [add]
    return np.atleast_1d(sign * (np.log(epsilon) - aim)), None  # (log 0: the search's errstate)

  try:
    with np.errstate(all="ignore"):  # (a start: round-off is no error, even under np.seterr)
      a, b, _, _, found = bracket_search(
          evaluate, snap(start), step=_STEP, lower=reach[0], upper=reach[1],
          iters=_HOST_SEARCH, tol=_TOL, whole=whole, ftol=_HOST_FTOL * _FTOL * margin,
          safe_end="b" if sign > 0 else "a", slope=_first_slope(opts.unknown, opts.target))
  except (ValueError, ArithmeticError):  # (a plan past the host's or the calibration's size)
    return None
  if not found[0]:
    return None
  x = b if sign > 0 else a
  if low[0] * _NEAR <= x[0] <= high[0] / _NEAR:
    return x, low, high
  return x, snap(np.maximum(x / _SPREAD, lo)), snap(np.minimum(x * _SPREAD, hi))


def _rdp_start(opts, flat, clt):
  """Each setting's calibration by RDP from the central-limit guess ``clt`` (nan where it finds
  none): for add/remove DP-SGD on the host at integer orders (``rdp.host_dpsgd_epsilon``:
  nothing compiled, ~1.5 s less on a process's first calibration), else by the RDP
  accountant's own compiled reads."""
  rdp_opts = dataclasses.replace(opts, accountant="rdp", eps_error=None)
  if opts.relation != "add_remove":
    found = _search(rdp_opts, flat, clt, Window(None), _SEARCH)
  else:
    with np.errstate(all="ignore"):  # (a start: round-off is no error, even under np.seterr)
      found = _search(rdp_opts, flat, clt, Window(None), _SEARCH, _host_rdp_read)
  return np.where(found.found, found.value, np.nan)


def _host_rdp_read(opts, flat, x, plan):
  """``_read`` of add/remove DP-SGD by RDP at integer orders, on the host: an upper (and a
  status) to start from, not the RDP accountant's (its orders are continuous)."""
  del plan
  _, _, other, sigma, q, steps = (np.asarray(a, np.float64) for a in flat)
  known = {"noise_multiplier": sigma, "sampling_rate": q, "steps": steps, opts.unknown: x}
  rate = np.ones_like(known["sampling_rate"]) if opts.full_batch else known["sampling_rate"]
  fn = _rdp.host_dpsgd_epsilon if opts.target == "epsilon" else _rdp.host_dpsgd_delta
  upper = fn(known["noise_multiplier"], rate, known["steps"], other)
  return results.Bounds(np.full_like(upper, np.nan), upper, upper,
                        np.full(upper.shape, results.LOWER_VACUOUS, np.int32))


def _next_window(unknown, value, upper, aim):
  """(low, high, where the search starts) of the next plan where the answer ``value`` lay at the
  edge of what the last plan served, towards larger epsilon: ``_NEAR`` on the safe side, and on
  the other as far as the target may lie by the slope ``_ELASTICITY`` from the certified
  ``upper`` read at ``value`` (at least ``_REACH``, at most 100x; then ``_SPREAD`` room). The
  search starts at that furthest point (the answer's estimate where epsilon falls no faster)."""
  with np.errstate(divide="ignore"):  # (an upper of 0: no slope read, the least reach)
    ratio = np.where(np.isfinite(upper) & (upper > 0.0) & (upper < aim), aim / upper, 1.0)
  reach = np.clip(ratio ** (1.0 / _ELASTICITY[unknown]), _REACH, 100.0)
  if unknown == "noise_multiplier":  # (larger epsilon: smaller sigma)
    return value / (reach * _SPREAD), value * _NEAR, value / reach
  return value / _NEAR, value * reach * _SPREAD, value * reach


def _short_window(opts, flat, window, short, last):
  """(low, high, where the search starts, the edge, its upper) of the next plan for the
  settings (``short``) whose whole window read above the target (no sign change up to its
  edge): the answer lies past the window's edge towards smaller epsilon. From the front door's
  upper at that edge, the estimate by the slope of log epsilon in log x: measured between this
  edge and the last one moved past (``last``: (edges, uppers), nan where none), else
  ``_ELASTICITY`` (epsilon falls ~1 / sigma, ~q, ~sqrt(T) where it is small; slower in q and T,
  faster in sigma, where it is large: a later round moves on); at least ``_REACH`` and at most
  100x past the edge (10x where the edge has no finite bound), with ``_SPREAD`` room beyond
  and half the way back to the edge (in log x) behind."""
  low, high = _search_bounds(opts, window, short.shape[0])
  edge = high if opts.unknown == "noise_multiplier" else low
  upper = np.full(edge.shape, np.inf)
  rows = np.flatnonzero(short)
  upper[rows] = _front_door_upper(opts, tuple(np.asarray(a)[rows] for a in flat), edge[rows])
  aim = np.asarray(flat[1]) * (1.0 - np.asarray(flat[0]))
  with np.errstate(divide="ignore", invalid="ignore"):
    measured = np.abs(np.log(last[1] / upper) / np.log(last[0] / edge))
  slope = np.where(np.isfinite(measured) & (measured > 0.0),
                   np.clip(measured, 0.1, 4.0), _ELASTICITY[opts.unknown])
  ratio = np.where(np.isfinite(upper) & (upper > aim), upper / aim, 10.0 ** slope)
  reach = np.clip(ratio ** (1.0 / slope), _REACH, 100.0)
  guess = edge * reach if opts.unknown == "noise_multiplier" else edge / reach
  # (the window reaches back half way to the edge in log x: the estimate may overshoot)
  back = np.sqrt(guess * edge)
  low, high = ((np.minimum(back, guess / _SPREAD), guess * _SPREAD)
               if opts.unknown == "noise_multiplier"
               else (guess / _SPREAD, np.maximum(back, guess * _SPREAD)))
  return low, high, guess, edge, upper


def _moved_window(opts, flat, found, window, failed, x0, cache, last):
  """(the next round's Window, its starts) where answers lay at the edge of what the plan served
  (``failed``): reaching past that edge towards larger epsilon (``_next_window``), or, where the
  whole window read above the target, past its other edge (``_short_window``); narrowed towards
  where the answer may lie furthest, or as far towards it as a plan fits (each anchor moved back
  towards the edge); other settings keep their windows and starts. Refused where no window
  moves the answer on by 2% (the plan beyond is too large). ``last``: (edges, uppers) of the
  last moves past a short window (nan where none), returned updated."""
  aim = np.asarray(flat[1]) * (1.0 - np.asarray(flat[0]))
  upper = np.asarray(found.bounds.upper)
  far_low, far_high, guess = _next_window(opts.unknown, found.value, upper, aim)
  edge = found.value  # (the last value served, past which the answer lies, and its upper)
  reached = upper
  at_low, at_high = _stuck(opts, found, window)
  short = failed & (at_high if opts.unknown == "noise_multiplier" else at_low)
  if np.any(short):
    s_low, s_high, s_guess, s_edge, s_upper = _short_window(opts, flat, window, short, last)
    last = (np.where(short, s_edge, last[0]), np.where(short, s_upper, last[1]))
    far_low, far_high = np.where(short, s_low, far_low), np.where(short, s_high, far_high)
    guess, edge = np.where(short, s_guess, guess), np.where(short, s_edge, edge)
    reached = np.where(short, s_upper, upper)
  low, high = np.where(failed, far_low, window.low), np.where(failed, far_high, window.high)
  anchor = np.where(failed, guess, np.clip(edge, low, high))
  moved, missing = _own_plan(opts, flat, low, high, anchor, np.clip(edge, low, high), cache)
  if missing:
    i = missing[0]
    raise _too_large(opts, flat, i, float(guess[i]), reached=(edge[i], reached[i]))
  x0 = np.where(failed, np.clip(guess, moved.low, moved.high), x0)
  if opts.unknown == "steps":
    x0 = np.round(x0)
  # (how far past the last edge the new window reaches, towards where the answer lies)
  if opts.unknown == "noise_multiplier":
    on = np.where(short, moved.high / edge, edge / moved.low)
  else:
    on = np.where(short, edge / moved.low, moved.high / edge)
  stuck = np.flatnonzero(failed & (on < 1.02))
  if stuck.size:
    i = int(stuck[0])
    raise _too_large(opts, flat, i, float(guess[i]), reached=(edge[i], reached[i]))
  return moved, x0, last


def _allowance(opts, flat, window, spent, sizes):
  """(the evaluations this round's search may read, the work spent with its compilation, the
  plan sizes compiled so far): at most ``_SEARCH``, within what is left of ``MAX_WORK_POINTS``
  (a new plan size is also charged a compilation; the values read are charged after the search,
  ``_spent``). Refused where fewer than ``_MIN_EVALUATIONS`` are left."""
  points = plan_points(window.plan, opts.atoms)
  compile_cost = 0 if window.plan.sizes in sizes else _COMPILE_POINTS
  evaluations = min(_SEARCH, (MAX_WORK_POINTS - spent - compile_cost) // points)
  if evaluations < _MIN_EVALUATIONS:  # (the batch shares the plan: named by its first)
    raise _too_large(opts, flat, 0, float(np.sqrt(window.low[0] * window.high[0])), spent=spent)
  return evaluations, spent + compile_cost, sizes | {window.plan.sizes}


def _spent(opts, window, spent, found):
  """The work spent after a search: the values its most costly setting read, on the plan."""
  return spent + int(np.max(found.reads)) * plan_points(window.plan, opts.atoms)


def _describe(opts, flat, index):
  """(target value, "(delta ..., sigma ..., ...)") of one setting of a flat batch, for messages."""
  _, target_value, other, sigma, q, steps = (float(np.asarray(a)[index]) for a in flat)
  setting = (f"({'delta' if opts.target == 'epsilon' else 'epsilon'} {other:g}"
             + "".join(f", {n} {v:g}" for n, v in zip(UNKNOWNS, (sigma, q, steps))
                       if n != opts.unknown) + ")")
  return target_value, setting


def _coarser_eps_error(opts, row, x, points, limit):
  """The smallest eps_error (of a few tried, up to 1) whose plan at ``x`` is within ``limit``
  grid points, or None."""
  factor = max(points / limit, 1.25) if np.isfinite(points) else 2.0
  coarser = opts.plan_error
  for _ in range(8):
    coarser = min(coarser * factor, 1.0)
    if _fits(_plan_or_none(opts, row, x, x, eps_error=coarser), opts, limit):
      return coarser
    if coarser == 1.0:
      return None
    factor = 1.5
  return None


def _constant_time(opts, flat, index, x):
  """[(accountant, its certified upper at ``x``)] of the constant-time accountants ("rdp",
  "spa") whose upper there is finite: those that can serve the setting (milliseconds warm)."""
  named = []
  for accountant in ("rdp", "spa"):
    other = dataclasses.replace(opts, accountant=accountant, eps_error=None)
    try:
      upper = float(_front_door_upper(other, _one(flat, index), np.array([x]))[0])
    except ValueError:
      continue
    if np.isfinite(upper):
      named.append((accountant, upper))
  return named


def _reachable(opts, flat, index, x, points, limit):
  """What serves a setting whose PLD plan near ``x`` (``points`` grid points) is too large for
  ``limit``: a coarser eps_error whose plan fits, and the constant-time accountants that give a
  finite bound there."""
  coarser = _coarser_eps_error(opts, _rows(flat)[index], x, points, limit)
  constant = [f"accountant={name!r} (certified, constant time in the number of steps: upper "
              f"{opts.target} {upper:.6g} at {opts.unknown} {x:.6g})"
              for name, upper in _constant_time(opts, flat, index, x)]
  offers = ([f"eps_error >= {coarser:.3g} (now {opts.plan_error:g}: a wider certified "
             "bracket)"] if coarser is not None else []) + constant
  if not offers:
    return (f"nothing here: no eps_error up to 1 brings the PLD plan within it, and neither "
            f"constant-time accountant ('rdp', 'spa') gives a finite upper at {opts.unknown} "
            f"{x:.6g}")
  lacking = [] if coarser is not None else ["no eps_error up to 1 brings the PLD plan within it"]
  if len(constant) < 2:
    lacking.append("the other constant-time accountants give no finite upper there" if constant
                   else "neither constant-time accountant ('rdp', 'spa') gives a finite upper "
                   "there")
  return " or ".join(offers) + "".join(f"; {text}" for text in lacking)


def _plan_needs(plan, opts):
  """What a plan's size is made of, for messages."""
  if plan is None:
    return "a loss grid wider than float64 serves"
  per_step, fft, low, block, _ = plan.sizes
  return (f"{_points(plan, opts):,} grid points (a {fft:,}-point FFT, a per-step grid of "
          f"{per_step:,} points at step {float(np.ravel(plan.grid_step)[0]):.3g} and {low:,} low "
          f"frequencies summed directly over {-(-per_step // block):,} blocks)")


def _too_large(opts, flat, index, x, reached=None, spent=None):
  """The ValueError for a setting whose answer needs a plan above ``MAX_PLAN_POINTS`` near ``x``
  (``reached``: the furthest value served and its certified upper, where the answer lies
  beyond it), or (``spent``: the work of the rounds so far) whose next search would go beyond
  ``MAX_WORK_POINTS``: the plan's size and what drives it, and what is reachable."""
  plan = _plan_or_none(opts, _rows(flat)[index], x, x)
  target_value, setting = _describe(opts, flat, index)
  head = (f"calibrating {opts.unknown} for {opts.target} {target_value:g} {setting} by the PLD "
          f"accountant: ")
  if spent is None:
    limit = MAX_PLAN_POINTS
    why = (f"near {opts.unknown} {x:.6g} its accuracy plan needs {_plan_needs(plan, opts)}, more "
           f"than the {MAX_PLAN_POINTS:,} a calibration computes on "
           f"(jaxacct.calibrate.MAX_PLAN_POINTS: ~2 s per value on one CPU core)")
  else:
    limit = MAX_PLAN_POINTS // 4  # (a plan on which a few searches fit the budget)
    why = (f"its searches would read more than the {MAX_WORK_POINTS:,} grid points a calibration "
           f"spends (jaxacct.calibrate.MAX_WORK_POINTS: ~30 s on one CPU core): {spent:,} read "
           f"so far, and near {opts.unknown} {x:.6g} each value needs "
           f"{_plan_needs(plan, opts)}")
  beyond = "" if reached is None else (
      f"; the target lies beyond {opts.unknown} {reached[0]:.6g}, whose certified upper "
      f"{opts.target} is {reached[1]:.6g}")
  reach = _reachable(opts, flat, index, x, _points(plan, opts), limit)
  return ValueError(f"{head}{why}{beyond}. Reachable: {reach}")


# ----------------------------------------------------------------------------------------------
# One round: the search, its checks, the front door's verification


@dataclasses.dataclass(frozen=True)
class Found:
  """A search's outcome per setting (host arrays): the ``value`` (the safe end of the final
  bracket), whether a sign change was ``found``, the ``bounds`` at the value, the other end
  of the bracket (``far``) with its status, and the values the search ``reads``."""

  value: np.ndarray
  found: np.ndarray
  bounds: object
  far_status: np.ndarray
  far: np.ndarray
  reads: np.ndarray


def _search_bounds(opts, window, settings):
  """(low, high) per setting where its search may read: the values its plan serves (the
  window, within the domain; whole steps), or the domain for a caller's plan."""
  lo, hi = DOMAIN[opts.unknown]
  if window.low is None:
    return np.full(settings, lo), np.full(settings, hi)
  low, high = np.clip(window.low, lo, hi), np.clip(window.high, lo, hi)
  return (np.round(low), np.round(high)) if opts.unknown == "steps" else (low, high)


def _search(opts, flat, x0, window, evaluations, read=None):
  """Every setting's certified search from ``x0`` on ``window``'s plan, within the values it
  serves (``_search_bounds``), reading at most ``evaluations`` values each. One setting, or a
  constant-time accountant: the bracket search runs on the host, each of its reads one call of
  a compiled accountant (``read``, default ``_read``; one PLD setting reads the front door
  itself). A batch
  on the PLD accountant: one compiled program (``_runner``), each setting's search stopping on
  its own. The value is the safe end of the final bracket: where the upper was seen below the
  aim (b for sigma, whose upper falls as it grows; a for q and T)."""
  low, high = _search_bounds(opts, window, np.shape(x0)[0])
  if opts.accountant == "pld" and np.shape(x0)[0] > 1:
    run = _compiled("search", *opts.key, True)
    value, (found, bounds, far_status, far, reads) = run(
        *flat, np.asarray(x0, np.float64), window.plan, np.asarray(low, np.float64),
        np.asarray(high, np.float64), np.float64(evaluations))
    return Found(np.asarray(value), np.asarray(found), jax.tree.map(np.asarray, bounds),
                 np.asarray(far_status), np.asarray(far), np.asarray(reads))
  sign = 1.0 if opts.unknown == "noise_multiplier" else -1.0
  margin = np.asarray(flat[0])
  aim = np.log(np.asarray(flat[1])) + np.log1p(-margin)

  def evaluate(x):
    bounds = (read or _read)(opts, flat, x, window.plan)
    upper = np.where(np.isnan(bounds.upper), np.inf, bounds.upper)  # (no bound: not below)
    with np.errstate(divide="ignore"):
      return sign * (np.log(upper) - aim), bounds

  a, b, at_a, at_b, found, reads = bracket_search(
      evaluate, np.asarray(x0, np.float64), step=_STEP, lower=low, upper=high, iters=evaluations,
      tol=_TOL, whole=opts.unknown == "steps", ftol=_FTOL * margin,
      safe_end="b" if sign > 0 else "a", count=True, slope=_first_slope(opts.unknown, opts.target))
  value, at, far, far_at = (b, at_b, a, at_a) if sign > 0 else (a, at_a, b, at_b)
  return Found(value, found, at, far_at.status, far, reads)


def _read(opts, flat, x, plan):
  """The accountant's certified bounds of every setting of a flat batch with the unknown at
  ``x`` (host arrays). One PLD setting reads the front door itself (``_reads_front_door``),
  one PLD setting against groups the front door's program on ``plan``, another accountant
  ``_reader``'s."""
  if _reads_front_door(opts, x):
    return _front_door_bounds(opts, flat, x)
  _, _, other, sigma, q, steps = (np.asarray(a, np.float64) for a in flat)
  known = {"noise_multiplier": sigma, "sampling_rate": q, "steps": steps, opts.unknown: x}
  if opts.accountant == "pld" and opts.unknown != "steps":
    known["steps"] = np.round(known["steps"])  # (the PLD accountant composes whole steps)
  if opts.accountant == "pld" and x.shape == (1,):
    row = {name: np.float64(value[0]) for name, value in known.items()}
    comp = _composition(row["noise_multiplier"], row["sampling_rate"], row["steps"],
                        opts.relation, opts.full_batch)
    bounds = _pld.single_program(opts.target)(comp, np.float64(other[0]), plan)
    return jax.tree.map(lambda leaf: np.reshape(np.asarray(leaf), (1,)), bounds)
  run = _compiled("read", opts.accountant, opts.target, opts.relation, opts.full_batch)
  bounds = run(other, *(np.asarray(known[name], np.float64) for name in UNKNOWNS), plan)
  return jax.tree.map(np.asarray, bounds)


def _reads_front_door(opts, x):
  """Whether the search of one PLD setting for an epsilon target (not against groups) reads the
  front door at each value: its own plan there and its program, as ``dpsgd_epsilon`` gives them
  in a fresh process. The answer is then exact against the front door (its check is the
  search's own read at the answer), and the search and a later call at the answer share their
  compilations (nearby values share plan sizes: the default calibration compiles one PLD
  program, not the window's and the answer's); the window only bounds where the search reads,
  and its plan (sized at the same delta) bounds each read's cost. (``dpsgd_delta`` plans down
  to its smallest_delta, 1e-10, where the window plans for a tenth of the target: a delta
  target keeps the window's program.)"""
  return (opts.accountant == "pld" and opts.target == "epsilon" and np.shape(x) == (1,)
          and not isinstance(opts.relation, GroupSteps))


def _check_found(opts, flat, found, spent, failed):
  """Raises for a setting whose search found no sign change and whose plan served every value
  it read (not ``failed``): its target unreachable where the search ran to the end of the
  domain, else (its evaluations spent first: with at least ``_MIN_EVALUATIONS`` the domain's
  ends are reached) beyond the work budget."""
  missed = np.flatnonzero(~found.found & ~failed)
  if not missed.size:
    return
  i = int(missed[0])
  lo, hi = DOMAIN[opts.unknown]
  ends = np.array([found.value[i], found.far[i]])
  if np.any(np.isclose(ends, lo, rtol=1e-9, atol=0.0) | np.isclose(ends, hi, rtol=1e-9, atol=0.0)):
    raise _unreachable(opts, flat, found.value, i)
  raise _too_large(opts, flat, i, float(found.value[i]), spent=spent)


def _stuck(opts, found, window):
  """(at the low end, at the high end) of its window, not the domain's: the settings whose
  search found no sign change there (it stops at the first value it may not read past)."""
  lo, hi = DOMAIN[opts.unknown]
  low, high = _search_bounds(opts, window, found.value.shape[0])
  at = lambda end: np.isclose(found.value, end, rtol=1e-12) | np.isclose(found.far, end, rtol=1e-12)
  return ~found.found & at(low) & (low > lo), ~found.found & at(high) & (high < hi)


def _failed_rows(opts, found, window, own_plan):
  """The settings whose answer lies past what their own plan served: their search stopped at
  the window's edge without a sign change (``_stuck``), or read values the plan's floor does
  not hold (not where the front door was read: its own plans and reruns are all there is)."""
  status = np.asarray(found.bounds.status) | found.far_status
  if _reads_front_door(opts, found.value):
    status = np.zeros_like(status)
  at_low, at_high = _stuck(opts, found, window)
  return own_plan & ((status & _SHARED_PLAN_FAILED != 0) | at_low | at_high)


def _front_door_bounds(opts, flat, value):
  """The certified bounds at ``value`` as ``jaxacct.dpsgd_epsilon``/``dpsgd_delta`` give them,
  with the call's accountant and eps_error (host arrays)."""
  _, _, other, sigma, q, steps = flat
  known = {"noise_multiplier": sigma, "sampling_rate": q, "steps": steps, opts.unknown: value}
  fn = dpsgd_epsilon if opts.target == "epsilon" else dpsgd_delta
  bounds = fn(known["noise_multiplier"], known["sampling_rate"], known["steps"], other,
              relation=opts.relation, accountant=opts.accountant, eps_error=opts.eps_error)
  return jax.tree.map(np.asarray, bounds)


def _front_door_upper(opts, flat, value):
  """The certified upper at ``value`` as ``jaxacct.dpsgd_epsilon``/``dpsgd_delta`` (against
  groups ``group_epsilon``/``group_delta``) give it, with the call's accountant and eps_error."""
  _, target_value, other, sigma, q, steps = flat
  known = {"noise_multiplier": sigma, "sampling_rate": q, "steps": steps, opts.unknown: value}
  if isinstance(opts.relation, GroupSteps):
    return np.asarray(opts.relation.upper(opts.target, known["noise_multiplier"],
                                          known["sampling_rate"], known["steps"], other,
                                          opts.accountant, opts.eps_error))
  return _front_door_bounds(opts, flat, value).upper


def _front_door_excess(opts, flat, value, read=None):
  """How far (relative) the front door's own certified upper at ``value`` lies above each target:
  0 where it meets it, 1e-3 where it gives no finite bound. ``read``: the front door's bounds
  at ``value`` where the search read them there itself (not read again)."""
  upper = _front_door_upper(opts, flat, value) if read is None else np.asarray(read.upper)
  target = np.asarray(flat[1])
  over = ~(upper <= target)  # (nan: no bound, over)
  return np.where(over, np.nan_to_num(upper / target - 1.0, nan=1e-3, posinf=1e-3), 0.0)


def _reaimed(flat, excess):
  """The flat batch aimed lower by twice each setting's excess (and round-off) where it has one:
  the front door's plan read a higher upper than the search's."""
  margin = np.asarray(flat[0]) + 2.0 * excess + np.where(excess > 0.0, _EXACT_MARGIN, 0.0)
  return (np.minimum(margin, _MAX_MARGIN),) + flat[1:]


def _unreachable(opts, flat, value, index):
  """The ValueError for a setting whose target no value of the unknown meets."""
  _, target_value, _, _, _, _ = (np.asarray(a)[index] for a in flat)
  lo, hi = DOMAIN[opts.unknown]
  at = float(np.asarray(value)[index])
  try:
    upper = float(_front_door_upper(opts, _one(flat, index), np.asarray([at]))[0])
  except ValueError:
    upper = float("nan")
  _, setting = _describe(opts, flat, index)
  what, unknown, target = f"{opts.target} {target_value:g}", opts.unknown, opts.target
  above = not upper <= target_value  # (nan or inf: no finite bound there)
  if unknown == "steps" and not above:
    why = f"every number of steps up to {hi:g} fits (certified upper {upper:.6g} at {at:g})"
  elif unknown == "steps":
    why = f"no number of steps >= 1 fits: one step already gives a certified upper of {upper:.6g}"
  elif unknown == "sampling_rate" and not above:
    why = (f"it would need a sampling rate above 1: the full batch already gives a certified "
           f"upper {target} of {upper:.6g}")
  elif above:
    why = (f"the {opts.accountant} accountant's certified upper {target} stays above the target "
           f"over [{lo:g}, {hi:g}] (at {at:.6g}: {upper:.6g}; inf means it gives no finite bound "
           "there)")
  else:
    why = (f"even {unknown} {at:.6g} keeps the certified upper {target} at {upper:.6g}: the "
           "target does not constrain it")
  return ValueError(f"the target {what} cannot be met by {unknown} {setting}: {why}")


def _gave_up(opts, flat, last, found, failed):
  """The error after ``_ROUNDS`` rounds: the answer still beyond the windows (a ValueError naming
  where, and what serves it), or the front door still reading above the target (a bug)."""
  if last == "window":
    i = int(np.flatnonzero(failed)[0])
    x = float(found.value[i])
    _, setting = _describe(opts, flat, i)
    constant = [name for name, _ in _constant_time(opts, flat, i, x)]
    then = (f"calibrate from there with accountant={' or '.join(map(repr, constant))} to locate "
            "it" if constant else "no constant-time accountant gives a finite bound there")
    return ValueError(
        f"calibrating {opts.unknown} by the PLD accountant: after {_ROUNDS} plans the answer "
        f"still lies beyond {opts.unknown} {x:.6g} (certified upper {opts.target} there "
        f"{float(found.bounds.upper[i]):.6g}; setting {setting}): the start was far off; {then}")
  return RuntimeError(f"calibrating {opts.unknown}: the certified upper at the answer stayed above "
                      f"the target after {_ROUNDS} attempts; please report this setting")


def _budget(target, epsilon, delta):
  """(the target's value, the other quantity): (epsilon, delta) or (delta, epsilon)."""
  return (epsilon, delta) if target == "epsilon" else (delta, epsilon)


def _quiet(_):
  """No progress report."""


def _traced(opts, flat, plan, shape):
  """The calibration under a caller's jit/vmap/grad: the start and the search in one program,
  on the caller's plan (nan where no value meets the target)."""
  if opts.accountant == "pld" and plan is None:
    raise ValueError("under jit/vmap/grad the inputs are traced and cannot be used to plan the "
                     "grid: pass plan=jaxacct.calibrate.make_plan(...) for the targets to serve")
  run = _compiled("search", *opts.key, False)
  lo, hi = (jnp.full(flat[1].shape, end) for end in DOMAIN[opts.unknown])
  value, (found, *_) = run(*flat, None, plan, lo, hi, _SEARCH)
  return jnp.reshape(jnp.where(found, value, jnp.nan), shape)


@float64
def _calibrate(unknown, target, accountant, relation, plan, size_cache, epsilon, delta, known,
               eps_error=None, gap=None, progress=None):
  """The front doors' one body: rounds of (budgeted search, window moved or front door checked).
  ``gap``: the most the aim may lie below the target (absolute; ``get_noise_multiplier``'s
  tolerance); ``progress``: called with a line of text per stage."""
  target_value, other = _budget(target, epsilon, delta)
  _check(unknown, target, accountant, relation, target_value, other, known, eps_error)
  opts = _options(unknown, target, accountant, relation, known, eps_error)
  shape, flat = _settings(unknown, known, target_value, other, _margin(opts, target_value, gap))
  if is_traced(flat):
    return _traced(opts, flat, plan, shape)
  report, own = progress or _quiet, accountant == "pld" and plan is None
  cache = (size_cache or _SizeCache()) if own else None  # (rounds reuse compiled sizes)
  report("starting point (central limit, RDP and the PLD on the host)")
  starts = _host_starts(opts, flat)
  window, x0 = _first_window(opts, flat, starts, cache) if own else (Window(plan), starts[0])
  spent, sizes, last = 0, frozenset(), None
  last_short = (np.full(x0.shape, np.nan), np.full(x0.shape, np.nan))
  for attempt in range(_ROUNDS):
    evaluations = _SEARCH
    if own:
      evaluations, spent, sizes = _allowance(opts, flat, window, spent, sizes)
    on = (" at the front door" if _reads_front_door(opts, x0)
          else f" on a {window.plan.fft_size:,}-point plan" if own else "")
    report(f"certified search {attempt + 1}{on}")
    found = _search(opts, flat, x0, window, evaluations)
    if own:
      spent = _spent(opts, window, spent, found)
    failed = _failed_rows(opts, found, window, own)
    _check_found(opts, flat, found, spent, failed)
    if np.any(failed):
      last = "window"
      window, x0, last_short = _moved_window(opts, flat, found, window, failed, x0, cache,
                                             last_short)
      continue
    last = "over"
    report("checking the answer at the front door")
    read = found.bounds if _reads_front_door(opts, found.value) else None
    excess = _front_door_excess(opts, flat, found.value, read)
    if not np.any(excess > 0.0):
      break
    flat = _reaimed(flat, excess)
  else:
    raise _gave_up(opts, flat, last, found, failed)
  value = found.value
  if unknown == "steps":
    report("the last whole step")
    value = _last_whole_step(opts, flat, value)
  return jax.device_put(np.reshape(np.asarray(value, np.float64), shape))  # (nothing compiled)


def _last_whole_step(opts, flat, steps):
  """The largest T with the front door's upper <= target, from ``steps`` (the search's answer
  on its own plan, aimed a margin m below the target, so ~2 m T steps below the last that fits
  where epsilon grows as sqrt(T)): ``largest_whole`` striding from there by max(1, m T) steps.
  A batch reads its settings together: ~log2(m T) + 3 front-door calls."""
  limit, lo, hi = np.asarray(flat[1]), *DOMAIN["steps"]
  fits = lambda t: _front_door_upper(opts, flat, t) <= limit
  stride = np.asarray(flat[0]) * np.asarray(steps, np.float64)
  last = largest_whole(fits, steps, stride, lo, hi)
  if last is None:
    raise RuntimeError("the front door's upper bound is not monotone in the number of steps "
                       f"near {steps}: please report this setting")
  none = np.flatnonzero(last < lo)
  if none.size:  # (the front door reads one step above the target)
    raise _unreachable(opts, flat, np.full(last.shape, lo), int(none[0]))
  return last


_TARGET_DOC = """
  Args:
    epsilon: the budget's epsilon: with ``target="epsilon"`` (default) the certified upper
      epsilon at ``delta`` is kept <= ``epsilon``; with ``target="delta"`` the epsilon at which
      the certified upper delta is kept <= ``delta``.
    delta: the budget's delta: the delta at which epsilon is read, or with ``target="delta"``
      the delta budget.
    target: "epsilon" (default) or "delta": which of the two is the budget to meet.
    accountant: "pld" (default, certified FFT accountant), "spa" or "rdp" (constant time).
    relation: "add_remove" (default) or "replace_one", as in ``jaxacct.dpsgd_epsilon``.
    plan: the PLD accountant's plan (``calibrate.make_plan``); needed under jit/vmap/grad.
    size_cache: a ``jaxacct.SizeCache`` shared with other calls (reuses compiled programs).
    eps_error: the PLD accountant's accuracy (default 0.01, as in ``jaxacct.epsilon``): a larger
      one serves settings whose plans would be too large (see below), the answer then certified
      at that accuracy (``dpsgd_epsilon(..., eps_error=...)`` reads the same upper).
    progress: called with one line of text as the calibration moves on (the CLI's progress bar).
  Array arguments broadcast into a batch (one compiled program). Raises ``ValueError`` on invalid
  input, on a target that no value reaches (the message says what is reachable), and where the
  PLD accountant would need a plan of more than ``MAX_PLAN_POINTS`` grid points (the message
  gives the plan's size, the ``eps_error`` that serves it and the constant-time accountants);
  under tracing an unreachable setting gives nan.
"""


def noise_multiplier(epsilon, delta, sampling_rate, steps, *, target="epsilon", accountant="pld",
                     relation="add_remove", plan=None, size_cache=None, eps_error=None,
                     progress=None) -> jax.Array:
  """The smallest noise multiplier whose certified upper bound meets the budget, for DP-SGD with
  Poisson rate ``sampling_rate`` over ``steps`` steps (float64 array; differentiable in the
  target, the rate and, with real-count accountants, the steps).
  """
  known = {"sampling_rate": sampling_rate, "steps": steps}
  return _calibrate("noise_multiplier", target, accountant, relation, plan, size_cache, epsilon,
                    delta, known, eps_error, progress=progress)


def sampling_rate(epsilon, delta, noise_multiplier, steps, *, target="epsilon",
                  accountant="pld", relation="add_remove", plan=None, size_cache=None,
                  eps_error=None, progress=None) -> jax.Array:
  """The largest Poisson sampling rate whose certified upper bound meets the budget, for DP-SGD
  with ``noise_multiplier`` over ``steps`` steps (float64 array; differentiable)."""
  known = {"noise_multiplier": noise_multiplier, "steps": steps}
  return _calibrate("sampling_rate", target, accountant, relation, plan, size_cache, epsilon,
                    delta, known, eps_error, progress=progress)


def steps(epsilon, delta, noise_multiplier, sampling_rate, *, target="epsilon",
          accountant="pld", relation="add_remove", plan=None, size_cache=None, eps_error=None,
          progress=None) -> jax.Array:
  """The largest whole number of DP-SGD steps whose certified upper bound meets the budget
  (float64 array of whole numbers; T + 1 steps would exceed it)."""
  known = {"noise_multiplier": noise_multiplier, "sampling_rate": sampling_rate}
  return _calibrate("steps", target, accountant, relation, plan, size_cache, epsilon,
                    delta, known, eps_error, progress=progress)


for _fn in (noise_multiplier, sampling_rate, steps):
  _fn.__doc__ += _TARGET_DOC


def group_noise_multiplier(epsilon, delta, steps, group_size, *, sampling_rate=None,
                           batch_size=None, dataset_size=None, target="epsilon",
                           accountant="pld", size_cache=None, eps_error=None,
                           progress=None) -> jax.Array:
  """The smallest noise multiplier whose certified upper bound meets the budget against groups
  of ``group_size`` examples (add or remove up to k: ``jaxacct.group_epsilon``), for DP-SGD with
  Poisson rate ``sampling_rate``, or a fixed batch of ``batch_size`` from a dataset of at least
  ``dataset_size``, over ``steps`` steps. ``group_size`` is one whole number (a static shape);
  the other arguments broadcast into a batch. With the PLD accountant the inputs must be
  concrete (it plans its own grids; its plan's size counts the k + 1 atoms of the mixture, so
  large groups meet ``MAX_PLAN_POINTS`` sooner); under jit/vmap/grad use ``accountant="spa"``
  or ``"rdp"`` (implicit gradients in the target and, for Poisson sampling, the rate)."""
  check_group_size(group_size)
  if np.ndim(group_size):
    raise ValueError(f"group_size must be one whole number here; got {group_size!r}")
  sampling = group_sampling(sampling_rate, batch_size, dataset_size)
  if sampling == "fixed":
    check_fixed_batch(batch_size, dataset_size)
    if np.ndim(batch_size) or np.ndim(dataset_size):
      raise ValueError("batch_size and dataset_size must be single whole numbers here")
    spec = GroupSteps(int(group_size), int(batch_size), int(dataset_size))
    sampling_rate = batch_size / dataset_size
  else:
    spec = GroupSteps(int(group_size))
  known = {"sampling_rate": sampling_rate, "steps": steps}
  return _calibrate("noise_multiplier", target, accountant, spec, None, size_cache, epsilon,
                    delta, known, eps_error, progress=progress)


@float64
def make_plan(unknown, epsilon, delta, *, noise_multiplier=None, sampling_rate=None,
              steps=None, target="epsilon", relation="add_remove", spread=1.5,
              eps_error=_EPS_ERROR, size_cache=None):
  """A PLD plan for calibrating ``unknown`` (one of ``UNKNOWNS``) to the given targets (arrays:
  a sweep) under jit/vmap/grad: it serves the answers within a factor ``spread`` of the
  central-limit guess (a wider ``spread`` for settings far from the central limit, e.g. small
  sampling rates with few steps; an answer outside gets status bits WINDOW_TOO_SMALL). Its size
  is the caller's to judge (``plan_points``); nothing here bounds it."""
  known = {name: value for name, value in (("noise_multiplier", noise_multiplier),
                                           ("sampling_rate", sampling_rate), ("steps", steps))
           if name != unknown}
  missing = [name for name, value in known.items() if value is None]
  if missing:
    raise ValueError(f"calibrating {unknown} needs {' and '.join(missing)}")
  target_value, other = _budget(target, epsilon, delta)
  _check(unknown, target, "pld", relation, target_value, other, known, eps_error)
  check_range("spread", spread, 1.0, np.inf)
  opts = _options(unknown, target, "pld", relation, known, eps_error)
  _, flat = _settings(unknown, known, target_value, other, _margin(opts, target_value))
  centre, _ = _starts(opts, flat)
  return _plan_for(opts, flat, centre, spread, size_cache)


# ----------------------------------------------------------------------------------------------
# Opacus's front door


# Opacus's accountant names (``opacus.accountants.create_accountant``) and jaxacct's own, read as
# jaxacct's certifying accountants: Opacus's "prv" (the PRV accountant of Gopi et al. 2021) is
# served by the certified PLD accountant, "rdp" by RDP at the best continuous order.
OPACUS_ACCOUNTANTS = {"prv": "pld", "rdp": "rdp", "pld": "pld", "spa": "spa"}
"""``get_noise_multiplier``'s ``accountant=`` names (Opacus's and jaxacct's) and the certifying
accountant that serves each: Opacus's "prv" is served by the certified PLD accountant."""
_GDP_REFUSED = (
    "accountant 'gdp' (Opacus's GaussianAccountant) reads epsilon off the central limit theorem "
    "(Bu et al. 2020: Poisson-subsampled steps taken as mu-GDP with mu = q sqrt(T (e^{1/sigma^2} "
    "- 1))): an approximation with no error bound, below the true epsilon for few steps or large "
    "rates, so no noise multiplier from it can be certified; use 'prv' (jaxacct's certified PLD "
    "accountant, the default) or 'rdp'")
_WHOLE = 1e-12  # a quotient this close (relative) to a whole number is that number (round-off)
_WHOLE_ULPS = 8.0  # ... or this many epsilons of its least precise input's dtype (float32: 1e-6)
_OPACUS_KEYWORDS = ("relation", "eps_error", "size_cache", "progress")
# Opacus's keywords (passed on to its accountants' get_epsilon) that are not taken here, and why.
_NOT_TAKEN = {
    "alphas": "jaxacct's RDP optimises the order itself (over continuous orders)",
    "delta_error": "the PLD calibration's delta slack is fixed (1e-3 of delta); its accuracy is "
                   "eps_error"}


def _whole_tolerance(*values):
  """The relative round-off of a quotient of ``values``: ``_WHOLE`` for float64 (and Python)
  numbers, ``_WHOLE_ULPS`` epsilons of a less precise float dtype (Opacus divides float32 rates
  in float32: 0.3 / float32(0.1) is 3 there, 2.99999996 in float64)."""
  eps = [np.finfo(np.asarray(v).dtype).eps for v in values
         if np.issubdtype(np.asarray(v).dtype, np.floating)]
  return max([_WHOLE] + [_WHOLE_ULPS * float(e) for e in eps])


def _single_number(name, value):
  """Raises ValueError naming ``name`` unless ``value`` is one number (not an array)."""
  if np.ndim(value):
    raise ValueError(f"{name} must be a single number: get_noise_multiplier calibrates one "
                     f"setting (calibrate.noise_multiplier takes arrays); got {value!r}")


def steps_from_epochs(epochs, sample_rate) -> int:
  """The number of steps a run of ``epochs`` epochs at Poisson rate ``sample_rate`` takes:
  1 / sample_rate steps an epoch, whole steps only (a last partial step is not taken), a
  quotient within round-off of a whole number being that number (the round-off of the inputs'
  dtype: ``_whole_tolerance``). (Opacus's ``int(epochs / sample_rate)`` loses a step there:
  0.29 / 0.01 = 28.999999999999996 gives 28 steps, while the run takes 29.)"""
  for name, value in (("epochs", epochs), ("sample_rate", sample_rate)):
    _single_number(name, value)
  check_range("epochs", epochs, 0.0, np.inf)
  check_range("sample_rate", sample_rate, 0.0, 1.0, high_open=False)
  quotient = float(epochs) / float(sample_rate)  # (float64, from the inputs' own values)
  nearest = round(quotient)
  tolerance = _whole_tolerance(epochs, sample_rate) * max(1.0, nearest)
  whole = nearest if abs(quotient - nearest) <= tolerance else int(quotient)
  if whole < 1:
    raise ValueError(f"epochs {epochs!r} at sample_rate {sample_rate!r} is {quotient:.6g} steps: "
                     "less than one whole step")
  return int(whole)


def get_noise_multiplier(*, target_epsilon, target_delta, sample_rate, epochs=None, steps=None,
                         accountant="pld", epsilon_tolerance=0.01, **kwargs) -> float:
  """Opacus-compatible (``opacus.accountants.utils.get_noise_multiplier``, Opacus 1.6): the
  noise multiplier of DP-SGD with Poisson rate ``sample_rate`` for ``target_epsilon`` at
  ``target_delta``, as a float.

  Give ``steps`` or ``epochs``; from epochs the steps the run takes are counted
  (``steps_from_epochs``: a quotient within round-off of a whole number is that number, where
  Opacus's ``int(epochs / sample_rate)`` may count one less). ``accountant`` takes Opacus's
  names: "prv" (served by jaxacct's certified PLD accountant; "pld", the default, is the same),
  "rdp" (RDP at the best continuous order, tighter than Opacus's fixed orders); "gdp" is
  refused (a central-limit approximation, no bound); jaxacct's "spa" is also taken. (Opacus's
  default is "rdp"; here the certified PLD, whose sigma is smaller.) As in Opacus, the epsilon
  at the answer is <= ``target_epsilon`` and within ``epsilon_tolerance`` (absolute) of it,
  here for the *certified upper* epsilon; the answer lands much closer (the PLD accountant
  aims 2e-4 epsilon below the target, never further than half the tolerance), and a tolerance
  it cannot meet is refused. Other keywords: ``relation``, ``eps_error`` (PLD), ``size_cache``,
  ``progress``, as in ``noise_multiplier``; Opacus's ``alphas`` and ``delta_error`` are refused
  with the reason. Every number is one number (one setting).
  """
  if accountant == "gdp":
    raise ValueError(_GDP_REFUSED)
  check_choice("accountant", accountant, tuple(OPACUS_ACCOUNTANTS) + ("gdp",))
  unknown_keywords = sorted(set(kwargs) - set(_OPACUS_KEYWORDS))
  if unknown_keywords:
    notes = "".join(f"; {name}: {_NOT_TAKEN[name]}" for name in unknown_keywords
                    if name in _NOT_TAKEN)
    raise ValueError(f"{', '.join(unknown_keywords)}: not taken here (get_noise_multiplier "
                     f"takes {', '.join(_OPACUS_KEYWORDS)}{notes})")
  if (steps is None) == (epochs is None):
    raise ValueError("get_noise_multiplier takes either steps or epochs (exactly one)")
  for name, value in (("target_epsilon", target_epsilon), ("target_delta", target_delta),
                      ("sample_rate", sample_rate), ("epochs", epochs), ("steps", steps),
                      ("epsilon_tolerance", epsilon_tolerance)):
    _single_number(name, value)
  check_range("epsilon_tolerance", epsilon_tolerance, 0.0, np.inf)
  check_range("target_epsilon", target_epsilon, 0.0, np.inf)
  if steps is None:
    steps = steps_from_epochs(epochs, sample_rate)
  ours = OPACUS_ACCOUNTANTS[accountant]
  sigma = float(_calibrate("noise_multiplier", "epsilon", ours,
                           kwargs.get("relation", "add_remove"), None, kwargs.get("size_cache"),
                           target_epsilon, target_delta,
                           {"sampling_rate": sample_rate, "steps": steps},
                           kwargs.get("eps_error"), gap=0.5 * float(epsilon_tolerance),
                           progress=kwargs.get("progress")))
  upper = float(dpsgd_epsilon(sigma, sample_rate, steps, target_delta, accountant=ours,
                              relation=kwargs.get("relation", "add_remove"),
                              eps_error=kwargs.get("eps_error")).upper)
  if not target_epsilon - upper <= epsilon_tolerance:
    raise ValueError(f"epsilon_tolerance {epsilon_tolerance:g} cannot be met: the certified upper "
                     f"epsilon at the answer (sigma {sigma:.10g}) is {upper:.10g}, "
                     f"{target_epsilon - upper:.3g} below the target (the {ours} accountant's "
                     "answer lands only as close as its accuracy plans agree); raise "
                     "epsilon_tolerance")
  return sigma
