"""Per-example (epsilon, delta) of DP-SGD with Poisson sampling (Koskela, Tobaben and Honkela
2023, Sec. 5 and App. D), from bucket counts kept on the device.

In the training step each listed example's noise ratio sigma~ = sigma C / min(||g||, C) is
rounded *down* onto a noise grid and counted ([examples, grid] integers: the counts are
sufficient, a composition does not depend on the order of its steps). Afterwards every example's
steps are one heterogeneous composition of the grid's few Poisson-subsampled Gaussians: each
grid model is discretised and transformed once (``jaxacct.pld``), and an example's composed
spectrum is the product of their powers, queried from its band (``spectrum.band_materialise``:
each certified delta in O(band), no inverse transform; the band is chosen per example from a
ladder so that the rest of its spectrum is negligible): no per-example discretisation. Examples
go in chunks (memory ~ the chunk), each split across the local devices (``shard_map``); a chunk's
compositions are batched (their count-weighted sums one matrix product) and its upper delta
curves (for the GDP fit) are one matrix product (``query.band_upper_curves``).

As for ``rdp_filter`` with q < 1: a step costs every example privacy whether or not it is
sampled, so list examples chosen independently of the step's batch (their norms at the step's
parameters, typically all N); the steps an example is not listed count as clipped (worst case).

A step is one ``update``, and an example is counted at most once in it. Listed twice under
``jit`` (concrete input raises): with q < 1, where the listing bounds each example's norm, it is
counted once at the larger of its norms; with q = 1, where the listed examples are the step's sum,
its copies' sum is a sensitivity the grid cannot hold, so the example is marked ``repeated``:
it has no guarantee (its epsilons are +inf).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import erfinv

from jaxacct import gdp, rdp
from jaxacct._inputs import check_delta
from jaxacct._numerics import F64_EPS, cpu_threads, float64, host_values, threaded_call
from jaxacct._solver import newton_in_bracket
from jaxacct.api import _dpsgd_model
from jaxacct.composition import Composition
from jaxacct.individual import _directed, _grid
from jaxacct.individual.filters import (DEFAULT_ORDERS, _check_count, _check_rate,
                                        _checked_batch, _dtype, _ledger_norms, _positive,
                                        _rdp_odometer, _rounded_step_rdp, _step_rdp, first_copies,
                                        listed, rdp_epsilon)
from jaxacct.individual._directed import host_round
from jaxacct.pld import accountant as _pld
from jaxacct.pld import plan as _plan
from jaxacct.pld import query, spectrum
from jaxacct.pld.distribution import PrivacyLossDistribution
from jaxacct.results import OUT_OF_RANGE, Bounds

# dp-accounting's default Renyi orders, for the RDP figure of the same sequence.
RDP_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64))
                   + [128, 256, 512, 1024])
_CURVE_POINTS = 96  # epsilon points at which the certified GDP curve is fitted

MEANING = {
    "pld": "epsilon(delta) of the example's realised per-step norms taken as fixed in advance "
           "(heterogeneous PLD, noise ratios rounded down onto the grid): upper certifies the "
           "realised sequence; lower and estimate are those of the rounded sequence",
    "gdp_mu": "mu whose GDP curve lies above the PLD's certified upper delta curve for every "
              "eps in [0, gdp_range] (delta of the PLD <= tail_delta beyond): (eps, "
              "delta_mu(eps) + tail_delta)-DP for every eps >= 0, for the fixed sequence",
    "gdp_epsilon": "epsilon(delta) of that statement: gdp mu at delta - tail_delta",
    "gdp_rdp_epsilon": "epsilon(delta) through RDP alpha mu^2 / 2 (the route Koskela et al. "
                       "justify under fully adaptive composition; it assumes the GDP curve "
                       "dominates for all eps, which this mu certifies up to tail_delta)",
    "rdp_epsilon": "epsilon(delta) of the RDP filter's ledger for the same (rounded) sequence: "
                   "subsampled-Gaussian RDP at dp-accounting's orders, its conversion",
}


# What a per-example epsilon of the bucket counter certifies, said where the figure appears.
CERTIFIES = ("An individual epsilon certifies the example's realised sequence of gradient norms as "
             "if it had been fixed in advance, not training that adapts to the data; the "
             "guarantee that holds under full adaptivity is the run's worst-case epsilon (or an "
             "individual filter's).")
"""What a bucket counter's per-example epsilon certifies
(``jaxacct.individual.COUNTER_CERTIFIES``), said beside the figures in reports."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BucketState:
  """Per-example counts of steps at each grid noise ([N, grid] int32), the steps taken, and the
  examples listed twice in one step with q = 1 ([N] bool: no guarantee, module docstring)."""

  counts: jax.Array
  steps: jax.Array
  repeated: jax.Array


@dataclasses.dataclass(frozen=True)
class PerExample:
  """Per-example privacy of DP-SGD (arrays [N], float64); ``meaning`` says what each certifies."""

  pld: Bounds
  gdp_mu: np.ndarray
  gdp_epsilon: np.ndarray
  gdp_rdp_epsilon: np.ndarray
  rdp_epsilon: np.ndarray
  delta: float
  tail_delta: float
  gdp_range: float
  meaning: dict = dataclasses.field(default_factory=lambda: dict(MEANING))

  def epsilons(self, field="pld"):
    """A field's epsilon per example (``pld`` reads its certified upper bound)."""
    return np.asarray(self.pld.upper if field == "pld" else getattr(self, field))

  def quantiles(self, q=(0.0, 0.1, 0.5, 0.9, 1.0), field="pld"):
    """Quantiles of a field's epsilon."""
    return np.quantile(self.epsilons(field), q)

  def histogram(self, bins=30, field="pld"):
    """(counts, edges) of a field's epsilon."""
    return np.histogram(self.epsilons(field), bins=bins)


class BucketCounter(NamedTuple):
  """``init()``; ``update(state, norms, indices, valid)`` -> state (one call per step);
  ``report(state, delta)`` -> ``PerExample`` (on the host, compiled per chunk);
  ``odometer(state, delta)`` -> each example's RDP epsilon so far (jit-able, to log); ``spec``:
  what gives the counts their meaning (the noise grid, the norms' dtype), as JSON values."""

  init: Callable
  update: Callable
  report: Callable
  odometer: Callable
  spec: dict


def bucket_counter(noise_multiplier, clip_norm, sampling_rate, num_examples, *, sigma_grid=None,
                   dtype=None) -> BucketCounter:
  """Per-example step counts of DP-SGD on a noise grid, and their per-example privacy report.

  ``sigma_grid``: increasing noise multipliers from at most ``noise_multiplier`` (default 200
  geometric points up to 100 sigma); ``dtype``: of the norms' comparison (default float32, or
  float64 under x64). See the module docstring for which examples to list at a step.
  """
  _positive("noise_multiplier", noise_multiplier)
  _positive("clip_norm", clip_norm)
  _check_count(num_examples)
  _check_rate(sampling_rate)
  sigma, q = float(noise_multiplier), float(sampling_rate)
  grid = _grid.checked_grid(_grid.noise_grid(sigma) if sigma_grid is None else sigma_grid, sigma)
  dtype = _dtype(dtype)
  thresholds = _grid.ratio_thresholds(grid, sigma, dtype)
  clip = host_round(float(clip_norm), dtype, -1)

  def init():
    return BucketState(jnp.zeros((num_examples, grid.size), jnp.int32), jnp.zeros((), jnp.int32),
                       jnp.zeros(num_examples, bool))

  def update(state, norms, indices, valid):
    """One step: each listed example's noise ratio counted (module docstring for copies)."""
    norms, indices, valid = _checked_batch(norms, indices, valid, num_examples)
    ratio = _directed.clipped_ratio(_ledger_norms(norms, dtype), clip)
    first = first_copies(indices, valid, num_examples)
    entered = listed(indices, valid, num_examples)
    rows = jnp.where(entered, indices, num_examples)
    # Each example's smallest noise among its copies (the grid's columns rise with the noise).
    column = jnp.full(num_examples + 1, grid.size, jnp.int32).at[rows].min(
        _grid.bucket(ratio, thresholds).astype(jnp.int32))
    counts = state.counts.at[jnp.where(first, indices, num_examples),
                             column[rows]].add(1, mode="drop")
    repeated = state.repeated
    if q == 1:
      repeated = repeated.at[jnp.where(entered & ~first, indices, num_examples)].set(
          True, mode="drop")
    return BucketState(counts, state.steps + 1, repeated)

  def report(state, delta, *, tail_delta=None, eps_error=0.01, chunk=256, devices=None,
             mesh=None):
    counts, steps, repeated = host_values((state.counts, state.steps, state.repeated))
    return per_example_privacy(counts, int(steps), grid, q, delta, tail_delta=tail_delta,
                               eps_error=eps_error, chunk=chunk, repeated=repeated,
                               devices=devices, mesh=mesh)

  def odometer(state, delta):
    """Each example's epsilon so far by RDP at ``DEFAULT_ORDERS`` (steps it was not listed at the
    grid's first noise): min over orders of counts @ table + the conversion, rounded up (the
    table's entries up, the products and sums raised by their round-off). O(N grid orders): a
    matrix product, cheap enough to log every few steps."""
    orders = np.asarray(DEFAULT_ORDERS, np.float64)
    table = _odometer_table(tuple(grid.tolist()), q, np.dtype(dtype))
    counts = state.counts.astype(dtype)
    counted = jnp.sum(state.counts, axis=1)
    if q < 1:
      unlisted = jnp.maximum(state.steps - counted, 0)
      counts = counts.at[:, 0].add(unlisted.astype(dtype))
    spent = (counts @ jnp.asarray(table)) * (1 + 4 * (grid.size + 2) * float(jnp.finfo(dtype).eps))
    eps = jnp.where(state.steps == 0, 0.0, _rdp_odometer(spent, orders, float(delta)))
    impossible = state.repeated | (counted > state.steps) | jnp.any(state.counts < 0, axis=1)
    return jnp.where(impossible, jnp.inf, eps)

  spec = dict(accountant="bucket_counter", dtype=np.dtype(dtype).name, sampling_rate=q,
              sigma_grid=grid.tolist())
  return BucketCounter(init, update, report, odometer, spec)


@functools.lru_cache(maxsize=8)
def _odometer_table(grid, q, dtype):
  """The odometer's step RDP on the grid at ``DEFAULT_ORDERS``, rounded up (built once)."""
  return _rounded_step_rdp(np.asarray(grid), q, np.asarray(DEFAULT_ORDERS, np.float64), dtype)


def _models(sigma, q):
  """The step of one grid point: the Poisson-subsampled Gaussian, or the Gaussian for q = 1."""
  return _dpsgd_model(sigma, q, "add_remove", q == 1)


def _plan_for(grid, q, steps, delta, eps_error):
  """One plan for every example: the worst one's (all steps at the grid's smallest noise: the
  widest composed loss, which every other example's lies within). Narrower examples share its
  grid step: their upper bounds stay certified (the discretisation dominates for any step),
  their brackets are only wider."""
  return _plan.make_plan(Composition.of((_models(grid[0], q), steps)), delta, eps_error, 1e-3)


@functools.partial(jax.jit, static_argnums=(1,))
def _stacked_terms(grid, q, plan):
  """Every grid model's discretised step, transformed once, with the logs of its whole spectrum
  (each example picks its own band): [directions, grid, ...]; and ``_largest_above`` of them."""
  whole = plan.fft_size // 2 + 1
  bands = _band_ladder(plan)
  # One (direction, grid point) pair at a time, direction-major: the map's stacked output is the
  # [directions, grid, ...] layout already (a map vmapped over the directions wrote its output
  # grid-major and then transposed it: twice the ~0.5 GB of the terms).
  adds, sigmas = jnp.repeat(jnp.asarray([0.0, 1.0]), grid.shape[0]), jnp.tile(grid, 2)

  def one(pair):
    terms = spectrum.entry_terms(_models(pair[1], q), pair[0], plan, whole)
    return terms, _stretch_maxima(terms, bands)

  flat, maxima = jax.lax.map(one, (adds, sigmas))
  shaped = lambda x: x.reshape((2,) + grid.shape + x.shape[1:])
  return jax.tree_util.tree_map(shaped, flat), _largest_above(shaped(maxima))


def _band_ladder(plan):
  """Bands from the plan's (sized for the worst, widest example) doubling to the whole
  spectrum: an example of smaller norms composes a narrower loss, whose spectrum is wider."""
  bands, whole = [], plan.fft_size // 2 + 1
  while plan.band * 2 ** len(bands) < whole:
    bands.append(plan.band * 2 ** len(bands))
  return tuple(bands) + (whole,)


def _stretch_maxima(terms, bands):
  """log max |F_k| of one entry's spectrum over each stretch [band_i, band_{i+1}) of the ladder
  (the last to its end): [bands]. Taken while the entry is built, not over the stacked spectra
  afterwards (a pass over ~0.5 GB and its temporaries)."""
  log_f, keep = terms["log_f"], terms["keep"]
  n = log_f.shape[-1]
  ends = [min(b, n) for b in bands] + [n]
  stretch = lambda lo, hi: (jnp.max(jnp.where(keep[lo:hi], jnp.real(log_f[lo:hi]),
                                              math.log(spectrum._TINY)))
                            if lo < hi else jnp.asarray(-jnp.inf))
  return jnp.stack([stretch(lo, hi) for lo, hi in zip(ends[:-1], ends[1:])])


def _largest_above(maxima):
  """log max_{k >= band} |F_k| of every entry and direction at each band, from the stretches'
  maxima [2, grid, bands]: [bands, 2, grid] (their running maximum from the top, raised by its
  round-off from log F: the dropped part's bound stays a bound)."""
  top = jax.lax.cummax(jnp.moveaxis(maxima, -1, 0), axis=0, reverse=True)
  return top + 4.0 * F64_EPS * (1.0 + jnp.abs(top))


def _cut(terms, band, log_largest):
  """The terms of one band: spectra cut to it, and the largest |F_k| above it."""
  cut = {key: value[..., :band] for key, value in terms.items()
         if key in ("log_f", "keep", "rate")}
  return dict(terms, **cut, largest=jnp.exp(log_largest))


def _band_choice(counts, log_largest, bands, plan):
  """Each example's narrowest band of the ladder above which its composed spectrum is
  negligible (``spectrum.high_band_negligible``, with a margin of e: the compiled bound decides
  what is certified, this only picks a band that makes it tight)."""
  high = np.einsum("ng,bdg->bnd", counts.astype(np.float64), np.asarray(log_largest))
  fine = np.stack([np.all(np.asarray(spectrum.high_band_negligible(
      high[b] + 1.0, dataclasses.replace(plan, band=band))), axis=1)
                   for b, band in enumerate(bands)], axis=1)
  fine[:, -1] = True  # the whole spectrum: nothing dropped
  return np.argmax(fine, axis=1)


def _gdp_mu(curve, at_zero, eps_points, tail_delta):
  """The smallest mu (of this construction) with delta_mu(eps_k) >= upper(eps_{k-1}) on every
  interval [eps_{k-1}, eps_k] of the points (eps_{-1} = 0) where upper(eps_{k-1}) > tail_delta:
  then delta_mu >= upper on the interval (both are non-increasing), and beyond the last such
  interval the PLD's delta is <= tail_delta.

  Each interval's residual z_mu(eps_k) - z(target_k) (z = sqrt(-2 log delta)) is decreasing in
  mu, so the answer is the largest of the points' own roots: the root of their maximum
  (``_envelope_root``). It is found first over the ``_CANDIDATES`` points of the highest root
  floors (``_root_floors``; the interval at 0, whose floor is nearly its root, mostly binds),
  raised by 1e-9 and checked on every interval; only if the check fails is it found over all
  the points, from there. An example is one call of a ``lax.map``, so only one branch runs."""
  lefts = jnp.concatenate([at_zero[None], curve[:-1]])
  live = lefts > tail_delta
  huge = lefts >= 1.0 - 1e-9
  targets = jnp.where(live & ~huge, lefts, 0.5)
  z_targets = jnp.sqrt(-2.0 * jnp.log(targets))
  los, his = gdp._mu_bracket(eps_points, targets)
  floors = jnp.where(live, _root_floors(los, targets), -jnp.inf)
  margin = 1e-12 * (1.0 + jnp.max(jnp.where(live, z_targets, 0.0)))
  # Raised by 1e-9, and checked with a margin far above z's round-off (~1e-15 relative).
  raised = lambda mu: mu * (1.0 + 1e-9)
  passes = lambda mu: jnp.max(jnp.where(live, gdp._z(mu, eps_points) - z_targets, -jnp.inf)) \
      <= -margin
  pick = jax.lax.top_k(floors, min(_CANDIDATES, floors.shape[0]))[1]
  first, _ = _envelope_root(eps_points[pick], z_targets[pick], live[pick], floors[pick], his[pick],
                            jnp.max(floors))

  def over_all():  # from the candidates' root (no larger than the answer); else the bracket's end
    mu, end = _envelope_root(eps_points, z_targets, live, floors, his, first)
    return jnp.where(passes(raised(mu)), raised(mu), raised(end))

  mu = jax.lax.cond(passes(raised(first)), lambda: raised(first), over_all)
  mu = jnp.where(jnp.any(live), mu, 0.0)
  return jnp.where(jnp.any(huge & live), jnp.inf, mu)


_CANDIDATES = 8  # points the GDP fit solves first (those of the highest root floors)


def _envelope_root(eps_points, z_targets, live, floors, his, start):
  """The root of the largest live residual z_mu(eps_k) - z_targets_k (decreasing in mu) by
  safeguarded Newton from ``start`` (a lower bound of it), bracketed by the points' root bounds
  ``floors`` and ``his``: (root, the bracket's upper end: its residual <= 0, or a ``his``)."""
  def largest(mu):
    values, slopes = jax.jvp(lambda m: gdp._z(m, eps_points) - z_targets,
                             (jnp.full(eps_points.shape, mu),), (jnp.ones(eps_points.shape),))
    values = jnp.where(live, values, -jnp.inf)
    top = jnp.argmax(values)
    return values[top], slopes[top]

  hi = jnp.max(jnp.where(live, his, 0.0))
  lo = jnp.minimum(jnp.maximum(jnp.max(floors), start), hi)
  root, _, end, _, _ = newton_in_bracket(largest, lo, hi, lo, iters=60, tol=1e-12 * hi)
  return root, end


def _root_floors(los, targets):
  """Lower bounds of the points' roots: the bracket's lower end, or the mu whose delta at eps = 0
  is the target (delta_mu(eps) <= delta_mu(0) = erf(mu / 2 sqrt 2)), lowered by 1e-6 for
  erfinv's round-off (a floor above a root would only cost the fit its fallback)."""
  return jnp.maximum(los, 2.0 * math.sqrt(2.0) * erfinv(targets) * (1.0 - 1e-6))


def _chunk(terms, rows, plan, delta, eps_points, tail_delta):
  """A chunk of examples (rows of counts): their composed PLDs (kept as their bands) together
  (the count-weighted sums are matrix products over the chunk); each one's certified
  epsilon(delta) one at a time; every upper delta curve at the points (and at 0) in one matrix
  product (``query.band_upper_curves``); the GDP mus one at a time."""
  composed = lambda row: PrivacyLossDistribution(
      plan=plan, **spectrum.band_fields_from_terms(terms, row, plan))
  plds = jax.vmap(composed)(rows)
  bounds = jax.lax.map(lambda pld: query.epsilon_from_pld(pld, delta), plds)
  curves = query.band_upper_curves(plds, plan, jnp.concatenate([jnp.zeros(1), eps_points]))
  mus = jax.lax.map(lambda curve: _gdp_mu(curve[1:], curve[0], eps_points, tail_delta), curves)
  return bounds, curves[:, 1:], mus


# Examples per chunk at most this many band coefficients in all (the chunk's composed PLDs are
# held together for its curves' matrix product: ~10 MB; a wide band takes fewer examples).
_CHUNK_COEFFICIENTS = 1 << 17


@functools.lru_cache(maxsize=8)
def _sharded_chunk(devices):
  """``_chunk`` compiled with its examples split across ``devices`` (shard_map over a 1-D mesh;
  the terms and everything else replicated): each device maps over its share. Returns it with
  the placements of its inputs (split, replicated)."""
  mesh = jax.make_mesh((len(devices),), ("examples",), devices=devices)
  spec, whole = jax.sharding.PartitionSpec("examples"), jax.sharding.PartitionSpec()
  # (No collectives: each share is independent, so the varying-axes check is not needed; the
  # accountant's loops start from constants, which that check would ask to be cast.)
  run = jax.jit(jax.shard_map(_chunk, mesh=mesh, in_specs=(whole, spec) + (whole,) * 4,
                              out_specs=spec, check_vma=False))
  return run, jax.NamedSharding(mesh, spec), jax.NamedSharding(mesh, whole)


def checked_counts(counts, steps, grid_size):
  """Bucket counts as int64 [N, grid]; ValueError unless they are whole, >= 0 and no example is
  counted more often than the steps taken (a ledger that cannot arise from one count per
  example and step)."""
  if not (isinstance(steps, (int, np.integer)) and not isinstance(steps, bool) and steps >= 0):
    raise ValueError(f"steps must be an integer >= 0; got {steps!r}")
  values = np.asarray(counts)
  if values.ndim != 2 or values.shape[1] != grid_size or values.shape[0] == 0:
    raise ValueError(f"counts must be [examples >= 1, {grid_size}] (one column per grid noise); "
                     f"got shape {values.shape}")
  whole = np.issubdtype(values.dtype, np.integer) or (
      np.issubdtype(values.dtype, np.floating) and np.all(values == np.round(values)))
  if not whole:
    raise ValueError("counts must be whole numbers of steps")
  values = values.astype(np.int64)
  if np.any(values < 0):
    raise ValueError(f"counts must be >= 0; examples {np.flatnonzero(np.any(values < 0, 1))[:4]}"
                     " have negative counts")
  over = np.flatnonzero(values.sum(axis=1) > steps)
  if over.size:
    raise ValueError(f"examples {over[:4]} are counted {values.sum(axis=1)[over[:4]]} times in "
                     f"{steps} steps: an example is counted at most once per step")
  return values


@float64
def per_example_privacy(counts, steps, sigma_grid, sampling_rate, delta, *, tail_delta=None,
                        eps_error=0.01, chunk=256, devices=None, repeated=None,
                        mesh=None) -> PerExample:
  """The per-example report from bucket counts ([N, grid] ints), the steps taken, the grid and
  the sampling rate (q < 1: steps an example was not listed count at the grid's first noise).
  ``repeated`` ([N] bool, the counter's): examples without a guarantee, reported +inf.

  Examples are composed ``chunk`` at a time (memory ~ chunk, not N), each chunk split across
  ``devices`` (default: this process's CPU devices, several with
  ``XLA_FLAGS=--xla_force_host_platform_device_count=K`` set before jax is imported; pass
  accelerators to run it there); the plans are computed on the first of them this process
  holds. ``mesh``: a ``jax.sharding.Mesh`` whose devices split every chunk instead, across
  processes too (with ``jax.distributed``: every process calls it with the same counts and gets
  the whole report)."""
  if mesh is not None:
    devices = tuple(mesh.devices.flat)
  devices = tuple(jax.local_devices(backend="cpu") if devices is None else devices)
  own = [d for d in devices if d.process_index == jax.process_index()]
  if not own:
    raise ValueError("none of the devices belongs to this process")
  with jax.default_device(own[0]):
    return _per_example_privacy(counts, steps, sigma_grid, sampling_rate, delta, tail_delta,
                                eps_error, chunk, devices, own[0], repeated)


def _per_example_privacy(counts, steps, sigma_grid, sampling_rate, delta, tail_delta, eps_error,
                         chunk, devices, home, repeated):
  grid = _grid.checked_grid(sigma_grid, np.inf)  # (the first noise charges uncounted steps)
  counts = checked_counts(counts, steps, grid.size)
  q = float(sampling_rate)
  if q < 1:
    counts[:, 0] += steps - counts.sum(axis=1)
  check_delta(delta)
  tail_delta = 1e-3 * delta if tail_delta is None else float(tail_delta)
  if not 0 < tail_delta < delta:
    raise ValueError(f"tail_delta must be in (0, delta); got {tail_delta!r}")
  worst = max(int(counts.sum(axis=1).max()), 1)
  plan = _plan_for(grid, q, worst, tail_delta, eps_error)  # (refuses a bad rate or eps_error)
  # The RDP column's table (a quadrature program: seconds, the first time for a grid and rate)
  # is built on a thread of its own, on ``home``, while the PLD spectra are.
  side = concurrent.futures.ThreadPoolExecutor(1)
  rdp_table = side.submit(threaded_call, _rdp_table, grid, q, device=home)
  side.shutdown(wait=False)
  # The GDP fit's points: up to where the worst example's upper delta falls below tail_delta.
  top = float(_worst_epsilon(grid[0], q, worst, tail_delta, plan)) * 1.1 + 4 * plan.grid_step
  h = float(plan.grid_step)
  eps_points = np.unique(np.ceil(np.linspace(0.0, top, _CURVE_POINTS + 1)[1:] / h) * h)
  terms, log_largest = _stacked_terms(jnp.asarray(grid), q, plan)
  bands = _band_ladder(plan)
  choice = _one_band_if_one_chunk(_band_choice(counts, log_largest, bands, plan), bands, chunk,
                                  devices)
  # The chosen bands' terms only (copies of the spectra's first coefficients): the whole spectra
  # (~0.5 GB at the default plan) are released before the chunks run.
  cuts = {b: _cut(terms, bands[b], log_largest[b]) for b in np.unique(choice)}
  del terms
  fixed = (jnp.asarray(delta), jnp.asarray(eps_points), jnp.asarray(tail_delta))
  bounds, curves, mus = _band_reports(counts, choice, cuts, bands, plan, fixed, chunk, devices)
  covered = curves[:, -1] <= tail_delta  # the fit's range reached the tail
  mus = np.where(covered, mus, np.inf)
  gdp_eps = np.asarray(gdp.epsilon_of_mu(np.maximum(mus, 1e-300), delta - tail_delta))
  gdp_rdp = _rdp_route(mus, delta)
  rdp_eps = rdp_epsilon(counts @ rdp_table.result(), RDP_ORDERS, delta)
  fields = (bounds, mus, np.where(np.isfinite(mus), gdp_eps, np.inf), gdp_rdp, rdp_eps)
  if repeated is not None:
    fields = _without_guarantee(fields, np.asarray(repeated, bool))
  return PerExample(*fields, float(delta), tail_delta, float(eps_points[-1]))


def _chunk_shape(members, band, chunk, devices):
  """(examples per chunk, the rows each chunk is padded to) for a band's ``members``: at most
  ``chunk`` examples and ``_CHUNK_COEFFICIENTS`` band coefficients a chunk; one shape (one
  compiled program) per band, a multiple of the device count."""
  per_chunk = min(chunk, max(len(devices), _CHUNK_COEFFICIENTS // band))
  size = min(per_chunk, 1 << max(members.size - 1, 15).bit_length())
  return per_chunk, -(-size // len(devices)) * len(devices)


def _one_band_if_one_chunk(choice, bands, chunk, devices):
  """Every example at the widest band chosen, where all of them fit in one chunk of it: one
  compiled program instead of one per band (each ~3-6 s to compile, against milliseconds to
  run a chunk). The bounds stay certified; a wider band's sums carry a larger round-off
  allowance, ~1e-8 relative (12-05: cold reports of 12-64 examples whose spectra needed two or
  three bands, 8-16 s against 25-34 s)."""
  widest = int(choice.max())
  per_chunk, _ = _chunk_shape(choice, bands[widest], chunk, devices)
  return np.full_like(choice, widest) if choice.size <= per_chunk else choice


def _padded(rows, size):
  """Count rows as float64 [size, grid], zero rows below (an example of no steps)."""
  padded = np.zeros((size, rows.shape[1]), np.int64)
  padded[:rows.shape[0]] = rows
  return padded.astype(np.float64)


def _band_reports(counts, choice, cuts, bands, plan, fixed, chunk, devices):
  """(bounds, upper delta curves, GDP mus) of every example, in the examples' order: each band's
  members (``choice``) in chunks (``_chunk_shape``) split across ``devices``, dispatched from
  one thread per free core (``cpu_threads``). ``cuts``: each chosen band's terms, released as
  its chunks are dispatched; ``fixed``: (delta, eps_points, tail_delta)."""
  run, split, replicated = _sharded_chunk(devices)
  outs, order = [], []
  with concurrent.futures.ThreadPoolExecutor(cpu_threads(devices)) as pool:
    for b in sorted(cuts):
      members, band = np.flatnonzero(choice == b), bands[b]
      band_plan, band_terms, band_fixed = jax.device_put(
          (dataclasses.replace(plan, band=band), cuts.pop(b), fixed), replicated)
      per_chunk, size = _chunk_shape(members, band, chunk, devices)
      for first in range(0, members.size, per_chunk):
        rows = counts[members[first:first + per_chunk]]
        block = jax.device_put(_padded(rows, size), split)
        args = (band_terms, block, band_plan, *band_fixed)
        outs.append((pool.submit(threaded_call, run, *args), rows.shape[0]))
      order.append(members)
    outs = [jax.tree_util.tree_map(lambda a, n=n: a[:n], out.result()) for out, n in outs]
  inverse = np.argsort(np.concatenate(order))
  return jax.tree_util.tree_map(lambda *a: np.concatenate(a)[inverse], *outs)


def _without_guarantee(fields, repeated):
  """The report's fields with the ``repeated`` examples' epsilons (and mu) +inf, their lower
  bounds nan and their status OUT_OF_RANGE."""
  bounds, *rest = fields
  inf = lambda a: np.where(repeated, np.inf, a)
  bounds = Bounds(np.where(repeated, np.nan, bounds.lower), inf(bounds.estimate),
                  inf(bounds.upper), np.where(repeated, bounds.status | OUT_OF_RANGE,
                                              bounds.status))
  return (bounds,) + tuple(inf(a) for a in rest)


def _worst_epsilon(sigma, q, steps, delta, plan):
  return _pld.epsilon(Composition.of((_models(sigma, q), steps)), delta, plan=plan).upper


def _rdp_route(mus, delta):
  """min over continuous orders of alpha mu^2 / 2 converted (jaxacct.rdp's conversion on
  Gaussian(1/mu)), every example in one program (padded to a power of two: few shapes)."""
  finite = np.isfinite(mus) & (mus > 0)
  out = np.where(finite, 0.0, np.where(mus == 0, 0.0, np.inf))
  if finite.any():
    size = 1 << max(int(finite.sum()) - 1, 0).bit_length()
    padded = np.ones(size)
    padded[:finite.sum()] = mus[finite]
    eps = np.asarray(_rdp_conversions(jnp.asarray(padded), math.log(delta)))
    out[finite] = np.where(np.isnan(eps), np.inf, eps)[:finite.sum()]
  return out


@jax.jit
def _rdp_conversions(mus, log_delta):
  """``rdp.epsilon_at_log_delta`` of one step of Gaussian(1/mu) for each mu."""
  one = lambda mu: rdp.epsilon_at_log_delta(Composition.of((_models(1.0 / mu, 1.0), 1)),
                                            log_delta)
  return jax.vmap(one)(mus)


def _rdp_table(grid, q):
  """The RDP of one step at each grid noise and order of ``RDP_ORDERS`` ([grid, orders]),
  computed once per grid and rate."""
  return _rdp_table_cached(tuple(np.asarray(grid, np.float64).tolist()), float(q))


@functools.lru_cache(maxsize=8)
def _rdp_table_cached(grid, q):
  return _step_rdp(grid, q, np.asarray(RDP_ORDERS, np.float64))


__all__ = ["BucketCounter", "BucketState", "CERTIFIES", "MEANING", "PerExample", "bucket_counter",
           "checked_counts", "per_example_privacy"]
