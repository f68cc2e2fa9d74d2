"""Accuracy plans: the static grid sizes of the PLD accountant, chosen on the host.

A ``Plan`` holds the grid step, tail levels and static sizes that one compiled accountant serves.
``make_plan`` sizes it for the worst case of a (batched) composition from a coarse planning pass
in numpy (nothing is compiled); ``batch_plan`` sizes each setting of a batch apart where that is
cheaper (the static sizes shared, the leaves per setting); ``widen`` and per-setting plans are
the planner's answers when a certificate fails on a plan (``jaxacct.pld.accountant`` runs that
policy). A plan is a pure function of its inputs, unless a ``SizeCache`` is passed: then static
sizes already compiled (in that cache) are reused when they fit, so nearby settings share one
compiled program.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxacct import _batch
from jaxacct._inputs import check_range
from jaxacct._numerics import LOSS_BIG
from jaxacct.pld.discretise import MAX_SPAN, TILTS, grid_cgf, split, window_edges


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
  """Accuracy plan: static grid sizes plus the (array) grid step and tail levels.

  Build it with ``make_plan`` for the worst case a sweep must serve (largest count, smallest
  sigma, largest rate, smallest delta); the certificates are checked for the actual traced
  values, so a plan that is too small widens the bounds (with a status bit), never falsifies them.
  """

  # (Arrays: numpy float64 from make_plan, any float64 array or tracer otherwise.)
  grid_step: jax.Array        # h, the loss grid step
  log_tail: jax.Array         # per step, log of the loss mass allowed outside its grid
  log_window_tail: jax.Array  # log of the composed mass allowed outside the FFT window
  delta_error: jax.Array      # lower bound slack eta as a fraction of the queried delta
  per_step_size: int = dataclasses.field(metadata=dict(static=True))
  fft_size: int = dataclasses.field(metadata=dict(static=True))
  # Spectrum coefficients k < low_frequencies are computed directly (spectrum.low_log_spectrum)
  # from block moments over blocks of ``block`` grid points.
  low_frequencies: int = dataclasses.field(default=1, metadata=dict(static=True))
  block: int = dataclasses.field(default=1, metadata=dict(static=True))
  # Spectrum coefficients k >= band are dropped when provably negligible (spectrum._high_band).
  band: int = dataclasses.field(default=0, metadata=dict(static=True))

  def __post_init__(self):
    if not self.low_frequencies <= self.band <= self.fft_size // 2 + 1:
      object.__setattr__(self, "band", self.fft_size // 2 + 1)

  @property
  def sizes(self):
    """The static sizes (what decides which compiled program serves this plan)."""
    return (self.per_step_size, self.fft_size, self.low_frequencies, self.block, self.band)


class SizeCache:
  """Static sizes of the plans made with it, offered for reuse by later plans.

  Pass one ``SizeCache`` to a sequence of ``make_plan`` (or front-door) calls: a new plan then
  reuses sizes within 2x of its grid sizes and 1-4x of its bands' needs, so nearby settings share
  one compiled program (a second setting takes milliseconds instead of a compilation). Without
  a cache a plan depends only on its own inputs.
  """

  def __init__(self):
    self._used = set()

  def __len__(self):
    return len(self._used)

  def add(self, sizes):
    self._used.add(tuple(sizes))

  def fitting(self, fits):
    """The smallest cached sizes for which ``fits(sizes)`` holds, or None."""
    reusable = [sizes for sizes in self._used if fits(sizes)]
    return min(reusable, key=lambda t: (t[1], t[0], t[2], t[3])) if reusable else None


def plan_points(plan: Plan, atoms: int = 2) -> int:
  """The work of one certified value on ``plan``, in grid points (~0.05 us each on one busy CPU
  core): the FFT; the per-step grid, whose loss CDFs cost about two points per atom of the loss
  model (``atoms``: 2 for DP-SGD's subsampled Gaussian, k + 1 against groups of k); and the low
  band's direct sums, one per frequency and block of the per-step grid
  (``spectrum.low_log_spectrum``: for a step whose loss is narrow against its range, e.g. a small
  sampling rate, these dominate, and a coarser grid does not shrink them). Calibration bounds
  it (``jaxacct.calibrate.MAX_PLAN_POINTS``), and group sweeps are cut by it."""
  per_step, fft, low, block, _ = plan.sizes
  return int(fft) + 2 * int(atoms) * int(per_step) + int(low) * -(-int(per_step) // int(block))


def _ladder(n: int, minimum: int = 64) -> int:
  """Rounds n up to 2^k x {16, 18, 20, 24, 27, 30, 32} / 16: sizes <= 12.5% apart whose only
  prime factors are 2, 3 and 5 (fast FFTs), few enough that compiled programs get reused."""
  n = max(int(n), minimum)
  k = max(n.bit_length() - 5, 0)
  for mult in (16, 18, 20, 24, 27, 30, 32):
    if mult << k >= n:
      return mult << k
  raise AssertionError("unreachable")


_PLAN_POINTS = 2048  # points of the planning pass's coarse grid for each step
_ATOM_STEP = 0.05    # the grid step for losses with atoms, as a fraction of eps_error
_PLAN_CHUNK = 256    # model settings per block of the planning pass (~4 MB per [settings, points])
_COMBINE_CHUNK = 4096  # settings per block when entries are combined with their counts


def _per_setting(mech, method, args):
  """``mech.method(*args_i)`` for each setting i of a flat batch of models (rows of ``args``),
  stacked: [settings, outputs, ...]. A batch of a model that ``broadcasts`` is called once (its
  parameters shaped to broadcast against the arguments' rows); one setting, or any other model,
  one setting at a time, as in the accountant (its parameters scalars, its event fields
  vectors)."""
  shape = np.shape(args[0])
  if shape[0] > 1 and mech.broadcasts():
    column = lambda a: np.reshape(np.asarray(a, np.float64), np.shape(a) + (1,) * (
        len(shape) - np.ndim(a)))
    outputs = getattr(jax.tree_util.tree_map(column, mech), method)(*map(column, args))
    return np.stack([np.broadcast_to(np.asarray(v, np.float64), shape) for v in outputs], 1)
  rows = []
  for i, row in enumerate(zip(*args)):
    one = _batch.take(mech, i)
    rows.append(np.stack([np.broadcast_to(np.asarray(v, np.float64), np.shape(row[0]))
                          for v in getattr(one, method)(*row)]))
  return np.stack(rows)


def _entry_stats(mech, flags, log_tail):
  """Per setting of one entry's model (over the model's own batch shape) and direction: the
  width of its loss range, the exact log-MGF of its coarse connect-the-dots step at +-TILTS and
  that step's variance. Each step is split as in ``discretise`` (``split``, without its round-off
  guard) on a coarse grid of ``_PLAN_POINTS`` points spanning its range."""
  flat, shape = _batch.flatten(jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), mech))
  settings = math.prod(shape)
  width = np.zeros(settings)
  cgf = np.zeros((len(flags), settings, 2, len(TILTS)))
  variance = np.zeros((len(flags), settings))
  directions = len(flags)
  chunk = max(1, _PLAN_CHUNK // directions)
  for first in range(0, settings, chunk):
    rows = slice(first, first + chunk)
    size = len(range(settings)[rows])
    # every direction of the block's settings as one batch of rows (direction-major): a model
    # that broadcasts is evaluated once for all of them
    both = _batch.select(flat, np.tile(np.arange(first, first + size), directions))
    add = np.repeat(np.asarray(flags, np.float64), size)
    lo, hi = np.split(_per_setting(both, "loss_range", (np.full(add.size, log_tail), add)), 2,
                      axis=1)
    lo = np.clip(lo, -LOSS_BIG / 2, LOSS_BIG / 2)
    hi = np.clip(hi, lo + 1e-12, LOSS_BIG / 2)
    width[rows] = np.max((hi - lo)[:, 0].reshape(directions, size), axis=0)
    h = np.maximum((hi - lo) / (_PLAN_POINTS - 8), 1e-9)
    start = np.floor(lo / h) - 1.0
    t = (start + np.arange(_PLAN_POINTS)) * h
    cdf_sf = np.moveaxis(_per_setting(both, "cdf_sf", (np.minimum(t, np.ceil(hi / h) * h), add)),
                         1, 0)
    pmf = split(cdf_sf, t, h, guard_ulps=0.0)[0]
    cgf[:, rows] = grid_cgf(pmf, start[:, 0], h[:, 0]).reshape(directions, size, 2, len(TILTS))
    weights = pmf / np.sum(pmf, axis=1, keepdims=True)
    mean = np.sum(weights * t, axis=1, keepdims=True)
    variance[:, rows] = np.sum(weights * (t - mean) ** 2, axis=1).reshape(directions, size)
  unflat = lambda a, lead=0: a.reshape(a.shape[:lead] + shape + a.shape[lead + 1:])
  return unflat(width), unflat(cgf, 1), unflat(variance, 1)


def _plan_widths(composition, flags, log_tail, log_window_tail):
  """Per setting of a (batched) composition: widest per-step loss range, width of the composed
  window and the count-weighted mean variance of a step's loss (+inf for a setting of no steps,
  which constrains nothing). On the host (numpy: nothing is compiled; a model written with
  jax.numpy alone runs eagerly here).

  Each entry's model is evaluated once per setting of its own batch shape (a model shared by a
  batch of count vectors once in all), then combined with the counts; the window comes from the
  same Chernoff rule as in ``spectrum.materialise``. (These only size the plan: the accountant
  checks its own window and widens the plan if the composed loss outgrows it.)
  """
  shape = _batch.batch_shape(composition)
  stats = [_entry_stats(mech, flags, log_tail) for mech in composition.mechanisms]
  counts = [np.broadcast_to(np.asarray(c, np.float64), shape).reshape(-1)
            for c in composition.counts]
  settings = math.prod(shape)
  widest, window, variance = np.zeros(settings), np.zeros(settings), np.full(settings, np.inf)

  def index(own):  # each setting's row in a model's own (flattened) batch
    rows = np.arange(math.prod(own)).reshape((1,) * (len(shape) - len(own)) + own)
    return np.broadcast_to(rows, shape).reshape(-1)

  flat_stats = []
  for width, cgf, var in stats:
    own = width.shape
    flat_stats.append((index(own), width.reshape(-1), cgf.reshape((len(flags), -1, 2, len(TILTS))),
                       var.reshape((len(flags), -1))))
  for first in range(0, settings, _COMBINE_CHUNK):
    rows = slice(first, first + _COMBINE_CHUNK)
    for at, width, _, _ in flat_stats:
      widest[rows] = np.maximum(widest[rows], width[at[rows]])
    for d in range(len(flags)):
      cgf, spread_sum, total = 0.0, 0.0, 0.0
      for count, (at, _, entry_cgf, entry_var) in zip(counts, flat_stats):
        k = count[rows]
        cgf = cgf + np.where(k[:, None, None] > 0, k[:, None, None] * entry_cgf[d, at[rows]], 0.0)
        spread_sum = spread_sum + k * entry_var[d, at[rows]]
        total = total + k
      bottom, top = window_edges(cgf, log_window_tail)
      window[rows] = np.maximum(window[rows], top - bottom)
      variance[rows] = np.minimum(variance[rows], np.where(
          total > 0, spread_sum / np.maximum(total, 1.0), np.inf))
  return widest, window, variance


# New bands get headroom: 2x for the band (it costs little), 1.25x for the low band (its direct
# sums cost ~ its square: ~5% of a warm call): with a SizeCache, one program serves a sweep of
# sigma over ~20-25% planned one setting at a time.
_LOW_HEADROOM = 1.25


def _static_sizes(per_step: int, fft: int, sd_bins: float, composed_sd_bins: float,
                  log_window_tail: float, cache: SizeCache | None):
  """(per_step, fft, low, block, band) for the needed grid sizes: a cached set if one fits."""
  def needs(n):  # low band and band needed on an FFT of n points
    return _low_band(n, sd_bins), _band(n, composed_sd_bins, log_window_tail)

  def fits(sizes):
    m, n, low, band = sizes
    need_low, need_band = needs(n)
    return (per_step <= m <= 2 * per_step and fft <= n <= 2 * fft
            and need_low <= low <= max(4 * need_low, 16) and need_band <= band <= 4 * need_band)

  reused = None if cache is None else cache.fitting(fits)
  if reused is not None:
    m, n, low, band = reused
  else:
    m, n = per_step, fft
    need_low, need_band = needs(n)
    low = min(n // 2 + 1, 2 * need_low if need_low <= 8
              else _ladder(_LOW_HEADROOM * need_low, minimum=8))
    band = min(n // 2 + 1, _ladder(2 * need_band, minimum=16))
  if cache is not None:
    cache.add((m, n, low, band))
  return m, n, low, _block(n, low), max(low, band)


@dataclasses.dataclass(frozen=True)
class _Needs:
  """What each setting of a (batched) composition needs of a plan (host values): its grid step
  ``h`` [settings], per-step loss range and composed window, in loss units [settings], its
  step's loss variance [settings], and the batch's tail levels and largest count."""

  h: np.ndarray
  ranges: np.ndarray
  windows: np.ndarray
  variances: np.ndarray
  log_tail: float
  log_window_tail: float
  total: float


def _needs(composition, delta, eps_error, delta_error) -> _Needs:
  """Each setting's needs (``_Needs``), at the batch's smallest delta and largest count. The
  grid step makes the certified bracket upper - lower about 2 ``eps_error``; the window holds
  all but a 1e-2 ``delta_error`` delta fraction of the composed mass."""
  delta = float(np.min(np.asarray(delta, dtype=np.float64)))
  total = float(sum(np.max(np.asarray(c, dtype=np.float64)) for c in composition.counts))
  eta = delta_error * delta
  log_tail = math.log(1e-3 * eta / max(total, 1.0))
  log_window_tail = math.log(1e-2 * eta)
  # Bracket ~ T beta(h) + h (sqrt(T log(1/eta)/2) + 1 + a few guard moves), beta(h) ~ h^2/8.
  target = 1.8 * eps_error  # the rest of 2 eps_error: the delta slack of the lower bound
  slope = math.sqrt(-0.5 * total * math.log(eta)) + 5.0
  curvature = total / 8.0
  h = 2.0 * target / (slope + math.sqrt(slope * slope + 4.0 * curvature * target))
  flags = np.array([0.0] if composition.symmetric else [0.0, 1.0])
  with np.errstate(all="ignore"):  # numpy evaluates both sides of the models' selects
    ranges, windows, variances = _plan_widths(composition, flags, np.float64(log_tail),
                                              np.float64(log_window_tail))
  # The split adds ~h^2/6 of variance per step; keep that below 1e-4 of the loss variance so the
  # estimate stays accurate when a step's loss is narrower than the grid (small q, large sigma).
  # (At most 64x finer: a degenerate loss, e.g. a point mass, is not refined without end.)
  # (fmin, fmax: a nan variance constrains nothing)
  steps = np.fmax(np.fmin(h, np.sqrt(6e-4 * variances)), h / 64.0)
  # Near an atom of the loss the split moves mass by up to h: the upper's own bias is first
  # order there (second order, ~T h^2/8, for a continuous loss). A step of at most
  # _ATOM_STEP x eps_error keeps it below ~1e-3 at the default plan; few steps of an atomic
  # loss have a small window, so the finer grid costs little.
  if any(mech.has_atoms() for mech in composition.mechanisms):
    steps = np.minimum(steps, _ATOM_STEP * eps_error)
  return _Needs(np.atleast_1d(steps), np.atleast_1d(ranges), np.atleast_1d(windows),
                np.atleast_1d(variances), log_tail, log_window_tail, total)


def _check_span(fft, span, eps_error):
  """Refuses a plan whose window spans more loss than float64 serves, or an FFT too large."""
  if span > MAX_SPAN:
    raise ValueError(f"the composed privacy loss spans {span:.0f} units: epsilon is far "
                     "beyond what this accountant serves (reduce steps or raise the noise)")
  if fft > 2**26:
    raise ValueError(f"the plan needs an FFT of {fft} points; raise eps_error (now {eps_error})")


def _shared_plan(needs: _Needs, eps_error, delta_error, size_cache) -> Plan:
  """One grid serving every setting: the finest step, the widest range and window."""
  h = float(np.min(needs.h))
  variance = float(np.min(needs.variances))
  per_step = _ladder(math.ceil(float(np.max(needs.ranges)) / h) + 3)
  fft = _ladder(max(per_step, math.ceil(1.03 * float(np.max(needs.windows)) / h) + 16))
  _check_span(fft, fft * h, eps_error)
  per_step, fft, low, block, band = _static_sizes(
      per_step, fft, math.sqrt(variance) / h, math.sqrt(needs.total * variance) / h,
      needs.log_window_tail, size_cache)
  return Plan(*(np.asarray(v, np.float64) for v in (h, needs.log_tail, needs.log_window_tail,
                                                    delta_error)),
              per_step, fft, low, block, band)


def _stacked_plan(needs: _Needs, eps_error, delta_error, size_cache) -> Plan:
  """Each setting its own grid and window, the static sizes shared (leaves [settings]): the
  largest setting's FFT, each setting's grid refined by the ratio of that FFT to its own (so
  its window and its low band and band needs stay what they were; ``stack_plans``)."""
  own_per_step = np.ceil(needs.ranges / needs.h) + 3.0
  own_fft = np.maximum(own_per_step, np.ceil(1.03 * needs.windows / needs.h) + 16.0)
  fft = _ladder(math.ceil(float(np.max(own_fft))))
  ratio = fft / own_fft
  h = needs.h / ratio
  per_step = _ladder(math.ceil(float(np.max(own_per_step * ratio))))
  _check_span(fft, fft * float(np.max(h)), eps_error)
  sd_bins = float(np.min(np.sqrt(needs.variances) / h))
  composed = float(np.min(np.sqrt(needs.total * needs.variances) / h))
  per_step, fft, low, block, band = _static_sizes(per_step, fft, sd_bins, composed,
                                                  needs.log_window_tail, size_cache)
  full = lambda v: np.full(h.shape, v, np.float64)
  return Plan(h, full(needs.log_tail), full(needs.log_window_tail), full(delta_error),
              per_step, fft, low, block, band)


def make_plan(composition, delta, eps_error=0.01, delta_error=1e-3, size_cache=None) -> Plan:
  """Accuracy plan for ``composition`` (concrete, checked; batched leaves = a sweep to serve).

  The grid step makes the certified bracket upper - lower about 2 * ``eps_error`` at the smallest
  ``delta``; the window holds all but a 1e-2 * delta_error * delta fraction of the composed mass.
  One grid serves the whole sweep (its leaves are scalars: a plan for jit/vmap/grad).
  """
  check_range("eps_error", eps_error, 0.0, 1.0, high_open=False)
  check_range("delta_error", delta_error, 0.0, 1.0)
  with jax.enable_x64(True):
    needs = _needs(composition, delta, eps_error, delta_error)
    return _shared_plan(needs, eps_error, delta_error, size_cache)


def group_plans(composition, delta, groups, eps_error=0.01, delta_error=1e-3) -> list:
  """``make_plan`` of each group of settings of a batch (``groups``: index arrays into the
  flattened batch), or the ValueError it refuses that group with. The models are evaluated
  once for all the groups that share what sizes the tails (their smallest delta and each
  entry's largest count), not once a group: a calibration plans a window per setting of a batch.
  (A block of settings evaluated at once may take scipy's ``erfc`` where one group alone takes
  libm's: the sizes can then differ in the last bits, not in what they certify.)"""
  check_range("eps_error", eps_error, 0.0, 1.0, high_open=False)
  check_range("delta_error", delta_error, 0.0, 1.0)
  flat, shape = _batch.flatten(composition)
  size = math.prod(shape)
  delta = np.broadcast_to(np.asarray(delta, np.float64), shape).reshape(-1)
  counts = [np.broadcast_to(np.asarray(c, np.float64), shape).reshape(-1) for c in flat.counts]
  classes = {}
  for i, group in enumerate(groups):
    key = (float(np.min(delta[group])),) + tuple(float(np.max(c[group])) for c in counts)
    classes.setdefault(key, []).append(i)
  plans = [None] * len(groups)
  with jax.enable_x64(True):
    for members in classes.values():
      rows = np.unique(np.concatenate([np.asarray(groups[i]) for i in members]))
      needs = _needs(_batch.select(flat, rows), delta[rows], eps_error, delta_error)
      where = np.full(size, -1)
      where[rows] = np.arange(rows.size)
      for i in members:
        try:
          plans[i] = _shared_plan(_subset(needs, where[np.asarray(groups[i])]), eps_error,
                                  delta_error, None)
        except ValueError as error:
          plans[i] = error
  return plans


def _subset(needs: _Needs, index) -> _Needs:
  """The needs of the settings at ``index`` (the batch's tail levels and count kept)."""
  return dataclasses.replace(needs, h=needs.h[index], ranges=needs.ranges[index],
                             windows=needs.windows[index], variances=needs.variances[index])


def batch_plan(composition, delta, eps_error=0.01, delta_error=1e-3, size_cache=None) -> Plan:
  """The front door's plan for a batch of settings (concrete, checked): ``make_plan``'s one grid
  serving them all, or, where it takes fewer grid points, each setting sized apart and the
  static sizes shared (``_stacked_plan``; leaves [settings]: for ``lax.map`` over the batch). A
  sweep of sigma takes its finest grid from its largest sigma and its widest window from its
  smallest: one grid for both costs ~2-3x the largest setting's own."""
  check_range("eps_error", eps_error, 0.0, 1.0, high_open=False)
  check_range("delta_error", delta_error, 0.0, 1.0)
  with jax.enable_x64(True):
    needs = _needs(composition, delta, eps_error, delta_error)
    builds = (_shared_plan, _stacked_plan) if needs.h.size > 1 else (_shared_plan,)
    plans, refused = {}, None
    for build in builds:  # (sized without the cache: it must not keep the plan not chosen)
      try:
        plans[build] = build(needs, eps_error, delta_error, None)
      except ValueError as error:  # (one grid may span too much where each setting's does not)
        refused = error
    if not plans:
      raise refused
    best = min(plans, key=lambda build: plan_points(plans[build]))
    return plans[best] if size_cache is None else best(needs, eps_error, delta_error, size_cache)


def _low_band(fft: int, sd_bins: float) -> int:
  """Coefficients computed directly: those with 1 - |F_k| < ~1e-2 for a step of ``sd_bins``
  grid points' spread (where round-off is amplified > ~40x)."""
  low = int(min(fft // 2 + 1, max(2, math.ceil(0.0225 * fft / max(sd_bins, 1e-9)) + 2)))
  low = _ladder(low, minimum=8) if low > 8 else low
  return min(low, fft // 2 + 1)


def _block(fft: int, low: int) -> int:
  """Block size of the low band's moments: theta b <= 0.05 for every frequency below ``low``."""
  return max(1, int(0.05 * fft / (2.0 * math.pi * low)))


def _band(fft: int, sd_bins: float, log_window_tail: float) -> int:
  """Spectrum coefficients kept when the rest is negligible: for a composed loss of ``sd_bins``
  grid points' spread, a Gaussian's |F_k| = exp(-2 pi^2 k^2 sd^2 / n^2) falls below the window
  level near k = n sqrt(level / 2) / (pi sd); four times that (a composition that is not yet
  Gaussian-like only takes the slower full-spectrum branch, see spectrum._high_band)."""
  level = -log_window_tail + 0.5 * math.log(fft) + 5.0
  k = 4.0 * fft * math.sqrt(0.5 * level) / (math.pi * max(sd_bins, 1e-9)) + 16
  return min(fft // 2 + 1, _ladder(k, minimum=16))


def stack_plans(plans) -> Plan:
  """One plan for a batch whose settings were planned apart: leaves [settings], static sizes
  shared. Each setting keeps its loss range and window, on a grid refined by the ratio of the
  largest FFT to its own (so its low band and band needs stay what they were): a batch then
  costs its largest setting's sizes, not those of one grid serving the whole batch."""
  fft = max(plan.fft_size for plan in plans)
  ratios = [fft / plan.fft_size for plan in plans]
  per_step = min(fft, _ladder(max(math.ceil(plan.per_step_size * r)
                                  for plan, r in zip(plans, ratios))))
  low = max(plan.low_frequencies for plan in plans)
  band = max(plan.band for plan in plans)
  leaves = [np.array([float(plan.grid_step) / r for plan, r in zip(plans, ratios)])]
  leaves += [np.array([float(getattr(plan, name)) for plan in plans])
             for name in ("log_tail", "log_window_tail", "delta_error")]
  return Plan(*leaves, per_step, fft, low, _block(fft, low), max(low, band))


def widen(plan: Plan, size_cache: SizeCache | None = None) -> Plan | None:
  """The same plan with a twice larger FFT window (after a WINDOW_TOO_SMALL status); None when
  that window would span more loss than float64 serves (``MAX_SPAN``)."""
  fft = _ladder(2 * plan.fft_size)
  if fft * float(plan.grid_step) > MAX_SPAN:
    return None
  low = min(2 * plan.low_frequencies, fft // 2 + 1)
  band = min(2 * plan.band, fft // 2 + 1)
  if size_cache is not None:
    size_cache.add((plan.per_step_size, fft, low, band))
  return dataclasses.replace(plan, fft_size=fft, low_frequencies=low, block=_block(fft, low),
                             band=band)
