"""Calibration: the noise multiplier, sampling rate or number of steps that spends a privacy budget.

For a target epsilon at a delta (or a target delta at an epsilon), each front door finds the
DP-SGD parameter at which the accountant's *certified upper bound* meets the target:

* ``noise_multiplier``: the smallest sigma with upper <= target (the upper falls as sigma grows);
* ``sampling_rate``: the largest q with upper <= target;
* ``steps``: the largest whole number of steps with upper <= target.

Method. The residual is log(upper / target), close to linear in log sigma (log q, log T). The
search starts from the saddle-point accountant's estimate calibrated the same way (constant
time), itself started from the central-limit (GDP) mu of Bu et al. (2020); it grows a bracket
from there and shrinks it by the Illinois secant (``_solver.bracket_search``: values only, since
a slope costs about as much as another certified value; one loop, so the accountant is compiled
once). The value returned
is the bracket end at which the upper bound was *evaluated* on the target's safe side, aimed at
``(1 - margin)`` times the target so that the front door's own plan (which may differ a little
from the calibration's) also stays below it; on the host the answer is then checked by the
front door itself. The root is differentiated by the implicit-function theorem
(``_solver.implicit_root``): d sigma / d target, d sigma / d q, ... (the PLD accountant composes
whole steps, so with it d / d steps raises; the saddle-point and RDP accountants take real
counts).

Plans. The PLD accountant needs an accuracy plan that serves every value the search visits. With
concrete inputs it is made here, one per setting, for a window around the start (within 15%),
and remade when the answer lies at the window's edge: the next window reaches past that edge
towards larger epsilon as far as the certified upper there says the target may lie (epsilon
falls at least as fast as 1 / sigma, 1 / q and 1 / sqrt(T)), never around the old one (a
window of a wide range of sigma takes the finest grid of its largest sigma and the loss range
of its smallest: the plan would grow without bound). Each plan's size is estimated on the host
before anything is computed: a window whose plan exceeds ``MAX_PLAN_POINTS`` is narrowed
towards the answer, and where even one value needs more, the calibration is refused with the
reason and what is reachable (a coarser ``eps_error``, or the constant-time "spa" and "rdp"
accountants). So a calibration answers after at most ``_ROUNDS`` searches on plans of bounded
size, or refuses. Under ``jit``/``vmap``/``grad`` pass ``plan=`` (from ``calibrate.make_plan``),
as for ``jaxacct.epsilon``.
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
from jaxacct._numerics import fast_jit, float64, is_traced, scoped_gradients
from jaxacct._solver import bracket_search, implicit_root
from jaxacct.api import RELATIONS, _dpsgd_model, dpsgd_delta, dpsgd_epsilon
from jaxacct.composition import Composition
from jaxacct.group import GroupSteps, check_fixed_batch, check_group_size, group_sampling
from jaxacct.pld import accountant as _pld
from jaxacct.pld import make_plan as _pld_plan
from jaxacct.pld.plan import SizeCache as _SizeCache
from jaxacct.pld.plan import stack_plans as _pld_stack
from jaxacct.pld.spectrum import integer_count

UNKNOWNS = ("noise_multiplier", "sampling_rate", "steps")
TARGETS = ("epsilon", "delta")
ACCOUNTANTS = ("pld", "spa", "rdp")  # the accountants that certify an upper bound
# The range searched for each unknown (a bracket is grown from the guess within it).
DOMAIN = {"noise_multiplier": (1e-3, 1e6), "sampling_rate": (1e-12, 1.0),
          "steps": (1.0, 1e7)}
# The PLD upper at the answer is aimed this far below the target (relative to max(1, epsilon)
# for an epsilon target, to delta for a delta one): two plans' uppers differ by less. The
# constant-time accountants compute the same function at the front door: only round-off.
_PLD_MARGIN = {"epsilon": 2e-4, "delta": 1e-3}
_EXACT_MARGIN = 1e-9
_TOL = 1e-9        # relative width of the final bracket of sigma or q
_FTOL = 0.05       # ... or the safe end's upper within this fraction of the margin below the aim
_SEARCH = 60       # evaluations budget of the secant search
_SPREAD = 1.15     # the PLD plan serves the start's value within this factor either side
_NEAR = 1.05       # a moved window keeps this much room on the answer's safe side ...
_REACH = 1.32      # ... and reaches at least this factor past it
# How fast the certified epsilon at least falls (in log-log) as the unknown moves to its safe
# side: ~1 / sigma and ~1 / q where epsilon is small (mu-GDP, epsilon ~ mu), faster elsewhere;
# ~1 / sqrt(T) (the central limit). A moved window reaches as far as these slopes allow.
_ELASTICITY = {"noise_multiplier": 1.0, "sampling_rate": 1.0, "steps": 0.5}
_ROUNDS = 6        # searches (each on one plan) before a calibration gives up
# The largest accuracy plan a PLD calibration computes on, in grid points (``plan_points``): a
# search reads ~10-30 certified values on it, ~1 s each at this size on 2 free CPU cores.
MAX_PLAN_POINTS = 2**25
_EPS_ERROR = 0.01  # the PLD accountant's default eps_error (its margin above scales with it)
_STEP = 0.01       # the certified search's first step from its start, in log x (then doubling)
_SHARED_PLAN_FAILED = results.WINDOW_TOO_SMALL | results.BELOW_FLOOR


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
  curve at epsilon. Only a start: the bracket search does not depend on its accuracy."""
  if target_kind == "epsilon":
    mu = _gdp._mu_impl(target, other)
  else:
    mu = _gdp._mu_impl(other, target)
  mu = jnp.where(jnp.isfinite(mu) & (mu > 0.0), mu, 1.0)
  scale = (relation.scale if isinstance(relation, GroupSteps)
           else 2.0 if relation == "replace_one" else 1.0)
  lo, hi = DOMAIN[unknown]
  if unknown == "noise_multiplier":
    guess = scale / jnp.sqrt(jnp.log1p(mu * mu / (q * q * steps)))
  elif unknown == "sampling_rate":
    guess = mu / jnp.sqrt(steps * jnp.expm1((scale / sigma) ** 2))
  else:
    guess = jnp.round(mu * mu / (q * q * jnp.expm1((scale / sigma) ** 2)))
  return jnp.clip(jnp.where(jnp.isfinite(guess), guess, 1.0), lo, hi)


def _core(unknown, accountant, target_kind, relation, full_batch, field, step, margin, target,
          other, sigma, q, steps, start, plan):
  """The calibrated value of one setting (implicit gradients) and (whether the search found a
  sign change, the bounds at the value, the status at the other end of the final bracket). The
  search reads ``field`` of the accountant's bounds ("upper"; "estimate" for a starting value)
  and grows its bracket from ``start`` by steps of ``step`` in log x, doubling."""
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

  lo, hi = DOMAIN[unknown]
  start = jax.lax.stop_gradient(start)

  def solve(_, __):
    a, b, at_a, at_b, found = bracket_search(
        evaluate, start, step=step, lower=lo, upper=hi, iters=_SEARCH, tol=_TOL,
        whole=unknown == "steps", ftol=_FTOL * margin, safe_end="b" if sign > 0 else "a")
    value, at, far = (b, at_b, at_a) if sign > 0 else (a, at_a, at_b)
    # (as floats: custom_root gives its aux float tangents)
    floats = dataclasses.replace(at, status=at.status.astype(jnp.float64))
    return value, (found.astype(jnp.float64), floats, far.status.astype(jnp.float64))

  if unknown == "steps" or field != "upper":  # a whole number, or a start: no gradient
    value, aux = solve(None, None)
  else:
    value, aux = implicit_root(lambda x: evaluate(x)[0], solve, start, has_aux=True)
  found, at, far_status = aux
  return value, (found > 0.0, dataclasses.replace(at, status=at.status.astype(jnp.int32)),
                 far_status.astype(jnp.int32))


def _start(unknown, target_kind, relation, full_batch, target, other, sigma, q, steps):
  """Where the certified search starts: the saddle-point accountant's estimate calibrated the
  same way (constant time; usually within 1e-3), from the central-limit guess; that guess
  itself where the saddle point finds nothing."""
  clt = _guess(unknown, target, other, sigma, q, steps, relation, target_kind)
  value, (found, _, _) = _core(unknown, "spa", target_kind, relation, full_batch, "estimate",
                               0.25, 0.0, target, other, sigma, q, steps, clt, None)
  lo, hi = DOMAIN[unknown]
  good = found & jnp.isfinite(value) & (value >= lo) & (value <= hi)
  return jax.lax.stop_gradient(jnp.where(good, value, clt))


def _runner(unknown, accountant, target_kind, relation, full_batch, with_start):
  """The compiled search over a flat batch (leaves [settings]): one program per plan and
  options. ``with_start``: the start is computed inside (``_start``) rather than given."""

  def one(margin, target, other, sigma, q, steps, start, plan):
    if with_start:
      start = _start(unknown, target_kind, relation, full_batch, target, other, sigma, q, steps)
    return _core(unknown, accountant, target_kind, relation, full_batch, "upper", _STEP, margin,
                 target, other, sigma, q, steps, start, plan)

  def run(margin, target, other, sigma, q, steps, start, plan):
    # (a plan's leaves: one per setting, or one for all)
    plans = jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, margin.shape), plan)
    args = (margin, target, other, sigma, q, steps, start, plans)
    chunk = None if (accountant == "pld" and jax.default_backend() == "cpu") else 64
    return jax.lax.map(lambda a: one(*a), args, batch_size=chunk)

  return fast_jit(scoped_gradients(run))


def _starter(unknown, target_kind, relation, full_batch):
  """``_start`` compiled over a flat batch."""

  def run(target, other, sigma, q, steps):
    one = lambda *a: _start(unknown, target_kind, relation, full_batch, *a)
    return jax.vmap(one)(target, other, sigma, q, steps)

  return fast_jit(run)


_RUNNERS = {}


def _compiled(kind, *key):
  """The compiled search ("search") or start ("start") for these static options."""
  if (kind, key) not in _RUNNERS:
    _RUNNERS[kind, key] = (_runner if kind == "search" else _starter)(*key)
  return _RUNNERS[kind, key]


# ----------------------------------------------------------------------------------------------
# Front doors: checks, plans, the host's verification


def _coarseness(eps_error):
  """How much coarser than the default the PLD plan is (>= 1): the aim's margin scales with it."""
  return max(1.0, (_EPS_ERROR if eps_error is None else float(eps_error)) / _EPS_ERROR)


def _check(unknown, target, accountant, relation, target_value, other, known, eps_error=None):
  check_choice("unknown", unknown, UNKNOWNS)
  check_choice("target", target, TARGETS)
  check_choice("accountant (a calibration needs a certified upper bound)", accountant,
               ACCOUNTANTS)
  if not isinstance(relation, GroupSteps):
    check_choice("relation", relation, RELATIONS)
  if accountant != "pld":
    check_unused(accountant, eps_error=eps_error)
  elif eps_error is not None:
    check_range("eps_error", eps_error, 0.0, 1.0, high_open=False)
  if target == "epsilon":
    check_range("epsilon", target_value, 0.0, np.inf)
    check_delta(other)
    floor = _PLD_MARGIN["epsilon"] * _coarseness(eps_error)  # (the upper is aimed this far below)
    if (accountant == "pld" and not is_traced(target_value)
        and np.any(np.asarray(target_value) <= floor)):
      raise ValueError(f"epsilon must be > {floor:g} for the PLD accountant's calibration (its "
                       f"certified upper is aimed {floor:g} below the target); got "
                       f"{target_value!r}")
  else:
    check_delta(target_value)
    check_epsilon(other)
  names = {"noise_multiplier": (0.0, np.inf, True), "sampling_rate": (0.0, 1.0, True),
           "steps": (1.0, np.inf, False)}
  for name, value in known.items():
    low, high, low_open = names[name]
    check_range(name, value, low, high, low_open=low_open, high_open=name != "sampling_rate")
    if name == "steps":
      check_whole("steps", value)


def _margin(accountant, target, target_value, eps_error=None):
  """How far below the target the upper is aimed (relative)."""
  if accountant != "pld":
    return jnp.full(jnp.shape(target_value), _EXACT_MARGIN)
  scale = _coarseness(eps_error)
  if target == "delta":
    return jnp.full(jnp.shape(target_value), _PLD_MARGIN["delta"] * scale)
  return _PLD_MARGIN["epsilon"] * scale * jnp.maximum(1.0, target_value) / target_value


def _settings(unknown, known, target_value, other, margin):
  """(margin, target, other, sigma, q, steps) broadcast and flattened (the unknown's slot: 1)."""
  full = [margin, target_value, other] + [known.get(name, 1.0) for name in UNKNOWNS]
  arrays = jnp.broadcast_arrays(*[jnp.asarray(a, jnp.float64) for a in full])
  return arrays[0].shape, tuple(jnp.ravel(a) for a in arrays)


def _starts(unknown, target, relation, full_batch, flat):
  """``_start`` of every setting of a flat batch (host values)."""
  return np.asarray(_compiled("start", unknown, target, relation, full_batch)(*flat[1:]))


# ----------------------------------------------------------------------------------------------
# Plans of bounded size


def _atoms(relation):
  """Components of one step's loss model: 2 for the subsampled Gaussian, k + 1 for a group."""
  return relation.group_size + 1 if isinstance(relation, GroupSteps) else 2


def plan_points(plan, atoms=2) -> int:
  """The work of one certified value on ``plan``, in grid points (~0.1 us each, measured on 2
  busy CPU cores): the FFT; the per-step grid, whose loss CDFs cost about two points per atom of
  the loss model (``atoms``: 2 for DP-SGD's subsampled Gaussian, k + 1 against groups of k); and
  the low band's direct sums, one per frequency and block of the per-step grid
  (``spectrum.low_log_spectrum``: for a step whose loss is narrow against its range, e.g. a small
  sampling rate, these dominate, and a coarser grid does not shrink them). ``MAX_PLAN_POINTS``
  bounds it."""
  per_step, fft, low, block, _ = plan.sizes
  return int(fft) + 2 * int(atoms) * int(per_step) + int(low) * -(-int(per_step) // int(block))


def _setting_plan(unknown, target, relation, full_batch, rows, low, high, eps_error, size_cache):
  """One plan serving the unknown over [low, high] for every row of ``rows`` ([target, other,
  sigma, q, steps] each), down to the smallest delta the search reads."""
  target_value, other, sigma, q, steps = np.reshape(rows, (-1, 5)).T
  lo, hi = DOMAIN[unknown]
  ends = np.clip(np.concatenate([np.broadcast_to(low, sigma.shape),
                                 np.broadcast_to(high, sigma.shape)]), lo, hi)
  known = {"noise_multiplier": np.tile(sigma, 2), "sampling_rate": np.tile(q, 2),
           "steps": np.tile(steps, 2)}
  known[unknown] = np.round(ends) if unknown == "steps" else ends
  comp = _composition(known["noise_multiplier"], known["sampling_rate"], known["steps"],
                      relation, full_batch)
  smallest = other if target == "epsilon" else 0.1 * target_value
  return _pld_plan(comp, np.tile(smallest, 2), eps_error=eps_error, size_cache=size_cache)


def _plan_for(unknown, target, relation, full_batch, flat, centre, spread, size_cache,
              eps_error=_EPS_ERROR):
  """One PLD plan serving the search of every setting of a flat batch within a factor
  ``spread`` of its ``centre`` (``make_plan``: one grid for the whole batch)."""
  rows = np.stack([np.asarray(a) for a in flat[1:]], axis=-1)
  centre = np.asarray(centre)
  return _setting_plan(unknown, target, relation, full_batch, rows, centre / spread,
                       centre * spread, eps_error, size_cache)


def _plan_or_none(unknown, target, relation, full_batch, row, low, high, eps_error,
                  size_cache=None):
  """``_setting_plan`` of one setting, or None where no plan serves it (the planner refuses a
  loss span beyond float64 or an FFT beyond 2^26 points)."""
  try:
    return _setting_plan(unknown, target, relation, full_batch, row, np.array([low]),
                         np.array([high]), eps_error, size_cache)
  except ValueError:
    return None


def _fits(plan, relation):
  return plan is not None and plan_points(plan, _atoms(relation)) <= MAX_PLAN_POINTS


def _fitted_plan(unknown, target, relation, full_batch, row, low, high, anchor, eps_error,
                 size_cache):
  """One setting's plan over [low, high], narrowed in log x towards ``anchor`` (where its answer
  is expected) until it fits ``MAX_PLAN_POINTS``: (plan, low, high); plan None where even the
  anchor alone does not fit. Only sizes are estimated (on the host) until the one kept."""
  def ends(t):
    return anchor * (low / anchor) ** t, anchor * (high / anchor) ** t

  trial = lambda t: _plan_or_none(unknown, target, relation, full_batch, row, *ends(t), eps_error)
  whole = _plan_or_none(unknown, target, relation, full_batch, row, low, high, eps_error,
                        size_cache)
  if _fits(whole, relation):
    return whole, low, high
  if not _fits(trial(0.0), relation):
    return None, anchor, anchor
  fit, over = 0.0, 1.0
  for _ in range(6):  # (the window kept to within ~1.5% of the largest that fits, in log x)
    mid = 0.5 * (fit + over)
    fit, over = (mid, over) if _fits(trial(mid), relation) else (fit, mid)
  low, high = ends(fit)
  return (_plan_or_none(unknown, target, relation, full_batch, row, low, high, eps_error,
                        size_cache), low, high)


def _own_plan(unknown, target, relation, full_batch, flat, low, high, anchor, eps_error,
              size_cache):
  """Each setting planned apart over its window (fitted to the budget) and the plans stacked
  (leaves [settings]: a batch of diverse settings costs its largest, not the union of all):
  (plan, low, high, the index of a setting whose anchor alone needs too large a plan, or None)."""
  rows = np.stack([np.asarray(a) for a in flat[1:]], axis=-1)
  keys = np.concatenate([rows, np.stack([low, high, anchor], axis=-1)], axis=-1)
  unique, index = np.unique(keys, axis=0, return_inverse=True)
  index = np.ravel(index)
  fitted = [_fitted_plan(unknown, target, relation, full_batch, key[:5], *key[5:], eps_error,
                         size_cache) for key in unique]
  for j, (plan, _, _) in enumerate(fitted):
    if plan is None:
      return None, low, high, int(np.flatnonzero(index == j)[0])
  plans = [fitted[j][0] for j in index]
  plan = plans[0] if len(plans) == 1 else _pld_stack(plans)
  return (plan, np.array([fitted[j][1] for j in index]), np.array([fitted[j][2] for j in index]),
          None)


def _next_window(unknown, value, upper, aim):
  """(low, high, where the search starts) of the next plan where the answer ``value`` lay at the
  edge of what the last plan served, towards larger epsilon: ``_NEAR`` on the safe side, and on
  the other as far as the target may lie by the slope ``_ELASTICITY`` from the certified
  ``upper`` read at ``value`` (at least ``_REACH``, at most 100x; then ``_SPREAD`` room). The
  search starts at that furthest point (the answer's estimate where epsilon falls no faster)."""
  ratio = np.where(np.isfinite(upper) & (upper > 0.0) & (upper < aim), aim / upper, 1.0)
  reach = np.clip(ratio ** (1.0 / _ELASTICITY[unknown]), _REACH, 100.0)
  if unknown == "noise_multiplier":  # (larger epsilon: smaller sigma)
    return value / (reach * _SPREAD), value * _NEAR, value / reach
  return value / _NEAR, value * reach * _SPREAD, value * reach


def _describe(unknown, target, flat, index):
  """(target value, "(delta ..., sigma ..., ...)") of one setting of a flat batch, for messages."""
  _, target_value, other, sigma, q, steps = (float(np.asarray(a)[index]) for a in flat)
  setting = (f"({'delta' if target == 'epsilon' else 'epsilon'} {other:g}"
             + "".join(f", {n} {v:g}" for n, v in zip(UNKNOWNS, (sigma, q, steps)) if n != unknown)
             + ")")
  return target_value, setting


def _coarser_eps_error(unknown, target, relation, full_batch, row, x, eps_error, points):
  """The smallest eps_error (of a few tried, up to 1) whose plan at ``x`` fits, or None."""
  factor = max(points / MAX_PLAN_POINTS, 1.25) if np.isfinite(points) else 2.0
  for _ in range(8):
    coarser = eps_error * factor
    if coarser > 1.0:
      coarser = 1.0
    if _fits(_plan_or_none(unknown, target, relation, full_batch, row, x, x, coarser), relation):
      return coarser
    if coarser == 1.0:
      return None
    factor *= 1.5
  return None


def _too_large(unknown, target, relation, full_batch, flat, index, x, eps_error, reached=None):
  """The ValueError for a setting whose answer needs a plan above ``MAX_PLAN_POINTS`` near ``x``
  (``reached``: the furthest value served and its certified upper, where the answer lies beyond
  it): the plan's size and what drives it, and what is reachable."""
  row = np.array([float(np.asarray(a)[index]) for a in flat[1:]])
  target_value, setting = _describe(unknown, target, flat, index)
  plan = _plan_or_none(unknown, target, relation, full_batch, row, x, x, eps_error)
  if plan is None:
    points, need = np.inf, "a loss grid wider than float64 serves"
  else:
    points = plan_points(plan, _atoms(relation))
    per_step, fft, low, block, _ = plan.sizes
    need = (f"{points:,} grid points (a {fft:,}-point FFT, a per-step grid of {per_step:,} "
            f"points at step {float(np.ravel(plan.grid_step)[0]):.3g} and {low:,} low "
            f"frequencies summed directly over {-(-per_step // block):,} blocks)")
  beyond = "" if reached is None else (
      f"; the target lies beyond {unknown} {reached[0]:.6g}, whose certified upper {target} is "
      f"{reached[1]:.6g}")
  coarser = _coarser_eps_error(unknown, target, relation, full_batch, row, x, eps_error, points)
  constant = "accountant='rdp' or 'spa' (certified, constant time in the number of steps)"
  reach = (f"eps_error >= {coarser:.3g} (now {eps_error:g}: a wider certified bracket), or "
           f"{constant}" if coarser is not None else
           f"{constant}; no eps_error up to 1 brings the PLD plan within it")
  return ValueError(
      f"calibrating {unknown} for {target} {target_value:g} {setting} by the PLD accountant: near "
      f"{unknown} {x:.6g} its accuracy plan needs {need}, more than the {MAX_PLAN_POINTS:,} a "
      f"calibration computes on (jaxacct.calibrate.MAX_PLAN_POINTS: ~1 s per value on 2 CPU "
      f"cores){beyond}. Reachable: {reach}")


# ----------------------------------------------------------------------------------------------
# The host's verification and messages


def _front_door_upper(unknown, target, accountant, relation, flat, value, eps_error=None):
  """The certified upper at ``value`` as ``jaxacct.dpsgd_epsilon``/``dpsgd_delta`` give it."""
  _, target_value, other, sigma, q, steps = flat
  known = {"noise_multiplier": sigma, "sampling_rate": q, "steps": steps, unknown: value}
  if isinstance(relation, GroupSteps):
    return np.asarray(relation.upper(target, known["noise_multiplier"], known["sampling_rate"],
                                     known["steps"], other, accountant, eps_error))
  fn = dpsgd_epsilon if target == "epsilon" else dpsgd_delta
  return np.asarray(fn(known["noise_multiplier"], known["sampling_rate"], known["steps"], other,
                       relation=relation, accountant=accountant, eps_error=eps_error).upper)


def _unreachable(unknown, target, accountant, relation, flat, value, index, eps_error=None):
  """The ValueError for a setting whose target no value of the unknown meets."""
  _, target_value, other, sigma, q, steps = (np.asarray(a)[index] for a in flat)
  lo, hi = DOMAIN[unknown]
  at = float(np.asarray(value)[index])
  one = tuple(np.asarray([v]) for v in (0.0, target_value, other, sigma, q, steps))
  try:
    upper = float(_front_door_upper(unknown, target, accountant, relation, one,
                                    np.asarray([at]), eps_error)[0])
  except ValueError:
    upper = float("nan")
  _, setting = _describe(unknown, target, flat, index)
  what = f"{target} {target_value:g}"
  above = not upper <= target_value  # (nan or inf: no finite bound there)
  if unknown == "steps" and not above:
    why = f"every number of steps up to {hi:g} fits (certified upper {upper:.6g} at {at:g})"
  elif unknown == "steps":
    why = f"no number of steps >= 1 fits: one step already gives a certified upper of {upper:.6g}"
  elif unknown == "sampling_rate" and not above:
    why = (f"it would need a sampling rate above 1: the full batch already gives a certified "
           f"upper {target} of {upper:.6g}")
  elif above:
    why = (f"the {accountant} accountant's certified upper {target} stays above the target over "
           f"[{lo:g}, {hi:g}] (at {at:.6g}: {upper:.6g}; inf means it gives no finite bound "
           "there)")
  else:
    why = (f"even {unknown} {at:.6g} keeps the certified upper {target} at {upper:.6g}: the "
           "target does not constrain it")
  return ValueError(f"the target {what} cannot be met by {unknown} {setting}: {why}")


def _budget(target, epsilon, delta):
  """(the target's value, the other quantity): (epsilon, delta) or (delta, epsilon)."""
  return (epsilon, delta) if target == "epsilon" else (delta, epsilon)


def _quiet(_):
  """No progress report."""


@float64
def _calibrate(unknown, target, accountant, relation, plan, size_cache, epsilon, delta, known,
               eps_error=None, gap=None, progress=None):
  """The front doors' one body. ``gap``: the most the aim may lie below the target (absolute;
  ``get_noise_multiplier``'s tolerance); ``progress``: called with a line of text per stage."""
  target_value, other = _budget(target, epsilon, delta)
  _check(unknown, target, accountant, relation, target_value, other, known, eps_error)
  report = progress or _quiet
  q = known.get("sampling_rate")
  full_batch = (q is not None and not is_traced(q) and bool(np.all(np.asarray(q) == 1.0))
                and not isinstance(relation, GroupSteps))
  margin = _margin(accountant, target, jnp.asarray(target_value, jnp.float64), eps_error)
  if gap is not None:
    margin = jnp.minimum(margin, gap / jnp.asarray(target_value, jnp.float64))
  shape, flat = _settings(unknown, known, target_value, other, margin)
  run = _compiled("search", unknown, accountant, target, relation, full_batch, is_traced(flat))
  if is_traced(flat):
    if accountant == "pld" and plan is None:
      raise ValueError("under jit/vmap/grad the inputs are traced and cannot be used to plan the "
                       "grid: pass plan=jaxacct.calibrate.make_plan(...) for the targets to serve")
    value, (found, _, _) = run(*flat, flat[1], plan)  # (the start is computed inside)
    return jnp.reshape(jnp.where(found, value, jnp.nan), shape)
  own_plan = accountant == "pld" and plan is None
  plan_error = _EPS_ERROR if eps_error is None else float(eps_error)
  if own_plan and size_cache is None:
    size_cache = _SizeCache()  # (the rounds' plans reuse each other's compiled sizes)
  report("starting point (saddle-point accountant)")
  start = _starts(unknown, target, relation, full_batch, flat)
  x0 = start
  if own_plan:
    plan, low, high, big = _own_plan(unknown, target, relation, full_batch, flat,
                                     start / _SPREAD, start * _SPREAD, start, plan_error,
                                     size_cache)
    if big is not None:
      raise _too_large(unknown, target, relation, full_batch, flat, big, start[big], plan_error)
  last = None
  for attempt in range(_ROUNDS):
    size = f" on a {plan.fft_size:,}-point plan" if own_plan else ""
    report(f"certified search {attempt + 1}{size}")
    value, (found, bounds, far_status) = run(*flat, x0, plan)
    value = np.asarray(value)
    missed = np.flatnonzero(~np.asarray(found))
    if missed.size:
      raise _unreachable(unknown, target, accountant, relation, flat, value, missed[0],
                         eps_error)
    failed = own_plan & ((np.asarray(bounds.status) | np.asarray(far_status))
                         & _SHARED_PLAN_FAILED != 0)
    if np.any(failed):
      # The answer lay at the edge of what the plan served (the start was far off): a window
      # reaching on past it, from where the answer was seen.
      last = "window"
      upper_there = np.asarray(bounds.upper)
      aim = np.asarray(flat[1]) * (1.0 - np.asarray(flat[0]))
      far_low, far_high, guess = _next_window(unknown, value, upper_there, aim)
      low, high = np.where(failed, far_low, low), np.where(failed, far_high, high)
      anchor = np.clip(value, low, high)
      plan, low, high, big = _own_plan(unknown, target, relation, full_batch, flat, low, high,
                                       anchor, plan_error, size_cache)
      x0 = np.where(failed, np.clip(guess, low, high), x0)
      if unknown == "steps":
        x0 = np.round(x0)
      reached = np.where(unknown == "noise_multiplier", value / low, high / value)
      stuck = np.flatnonzero(failed & (reached < 1.02)) if big is None else [big]
      if len(stuck):
        i = stuck[0]
        x = float(far_low[i] * _SPREAD if unknown == "noise_multiplier" else far_high[i] / _SPREAD)
        raise _too_large(unknown, target, relation, full_batch, flat, i, x, plan_error,
                         reached=(float(value[i]), float(upper_there[i])))
      continue
    last = "over"
    report("checking the answer at the front door")
    upper = _front_door_upper(unknown, target, accountant, relation, flat, value, eps_error)
    over = ~(upper <= np.asarray(flat[1]))  # (nan: no bound, over)
    if not np.any(over):
      break
    # Where the front door's own plan reads a higher upper, aim lower by twice the excess.
    excess = np.where(over, np.nan_to_num(upper / np.asarray(flat[1]) - 1.0, nan=1e-3,
                                          posinf=1e-3), 0.0)
    flat = (flat[0] + 2.0 * excess + np.where(over, _EXACT_MARGIN, 0.0),) + flat[1:]
  else:
    if last == "window":
      i = int(np.flatnonzero(failed)[0])
      raise ValueError(
          f"calibrating {unknown} by the PLD accountant: after {_ROUNDS} plans the answer still "
          f"lies beyond {unknown} {value[i]:.6g} (certified upper {target} there "
          f"{float(upper_there[i]):.6g}; setting {_describe(unknown, target, flat, i)[1]}): the "
          "start was far off; calibrate from there with accountant='rdp' or 'spa' to locate it")
    raise RuntimeError(f"calibrating {unknown}: the certified upper at the answer stayed above "
                       f"the target after {_ROUNDS} attempts; please report this setting")
  if unknown == "steps":
    report("the last whole step")
    value = _last_whole_step(target, accountant, relation, flat, value, eps_error)
  return jnp.reshape(jnp.asarray(value), shape)


def _last_whole_step(target, accountant, relation, flat, steps, eps_error=None):
  """The largest T with the front door's upper <= target, starting from ``steps`` (the search's
  answer on its own plan): a step or two either way at most."""
  limit = np.asarray(flat[1])
  upper = lambda t: _front_door_upper("steps", target, accountant, relation, flat, t, eps_error)
  for _ in range(8):
    here = upper(steps) <= limit
    above = upper(steps + 1) <= limit
    if np.all(here & ~above):
      return steps
    steps = np.where(~here, steps - 1, np.where(above, steps + 1, steps))
  raise RuntimeError("the front door's upper bound is not monotone in the number of steps near "
                     f"{steps}: please report this setting")


_TARGET_DOC = """
  Args:
    epsilon, delta: the budget. With ``target="epsilon"`` (default) the certified upper epsilon
      at ``delta`` is kept <= ``epsilon``; with ``target="delta"`` the certified upper delta at
      ``epsilon`` is kept <= ``delta``.
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
  q = known.get("sampling_rate")
  full_batch = q is not None and bool(np.all(np.asarray(q) == 1.0))
  margin = _margin("pld", target, jnp.asarray(target_value, jnp.float64), eps_error)
  _, flat = _settings(unknown, known, target_value, other, margin)
  centre = _starts(unknown, target, relation, full_batch, flat)
  return _plan_for(unknown, target, relation, full_batch, flat, centre, spread, size_cache,
                   eps_error)


# ----------------------------------------------------------------------------------------------
# Opacus's front door


# Opacus's accountant names (``opacus.accountants.create_accountant``) and jaxacct's own, read as
# jaxacct's certifying accountants: Opacus's "prv" (the PRV accountant of Gopi et al. 2021) is
# served by the certified PLD accountant, "rdp" by RDP at the best continuous order.
OPACUS_ACCOUNTANTS = {"prv": "pld", "rdp": "rdp", "pld": "pld", "spa": "spa"}
_GDP_REFUSED = (
    "accountant 'gdp' (Opacus's GaussianAccountant) reads epsilon off the central limit theorem "
    "(Bu et al. 2020: Poisson-subsampled steps taken as mu-GDP with mu = q sqrt(T (e^{1/sigma^2} "
    "- 1))): an approximation with no error bound, below the true epsilon for few steps or large "
    "rates, so no noise multiplier from it can be certified; use 'prv' (jaxacct's certified PLD "
    "accountant, the default) or 'rdp'")
_WHOLE = 1e-12  # a quotient this close (relative) to a whole number is that number (round-off)
_OPACUS_KEYWORDS = ("relation", "eps_error", "size_cache", "progress")


def steps_from_epochs(epochs, sample_rate) -> int:
  """The number of steps a run of ``epochs`` epochs at Poisson rate ``sample_rate`` takes:
  1 / sample_rate steps an epoch, whole steps only (a last partial step is not taken), a
  quotient within round-off of a whole number being that number. (Opacus's
  ``int(epochs / sample_rate)`` loses a step there: 0.29 / 0.01 = 28.999999999999996 gives 28
  steps, while the run takes 29.)"""
  check_range("epochs", epochs, 0.0, np.inf)
  check_range("sample_rate", sample_rate, 0.0, 1.0, high_open=False)
  quotient = float(epochs) / float(sample_rate)
  nearest = round(quotient)
  whole = nearest if abs(quotient - nearest) <= _WHOLE * max(1.0, nearest) else int(quotient)
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
  aims 2e-4 max(1, epsilon) below the target, never further than half the tolerance), and a
  tolerance it cannot meet is refused. Other keywords: ``relation``, ``eps_error`` (PLD),
  ``size_cache``, ``progress``, as in ``noise_multiplier``.
  """
  if accountant == "gdp":
    raise ValueError(_GDP_REFUSED)
  check_choice("accountant", accountant, tuple(OPACUS_ACCOUNTANTS) + ("gdp",))
  unknown_keywords = sorted(set(kwargs) - set(_OPACUS_KEYWORDS))
  if unknown_keywords:
    raise ValueError(f"{', '.join(unknown_keywords)}: not taken here (get_noise_multiplier "
                     f"takes {', '.join(_OPACUS_KEYWORDS)}; jaxacct's RDP optimises the order "
                     "itself)")
  if (steps is None) == (epochs is None):
    raise ValueError("get_noise_multiplier takes either steps or epochs (exactly one)")
  check_range("epsilon_tolerance", epsilon_tolerance, 0.0, np.inf)
  check_range("target_epsilon", target_epsilon, 0.0, np.inf)
  if np.ndim(target_epsilon) or np.ndim(epsilon_tolerance):
    raise ValueError("get_noise_multiplier calibrates one setting: give scalars (or use "
                     "calibrate.noise_multiplier for a batch)")
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
