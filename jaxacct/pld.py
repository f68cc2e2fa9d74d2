"""The PLD accountant: grid discretisation of each step's privacy loss, FFT composition, queries.

Method (a certified variant of the PRV accountant of Gopi, Lee and Wutschitz, seed 002):

* **Connect-the-dots discretisation.** Each step's loss L, restricted to a cell [a, b] of the grid
  h*Z, is split between a and b so that E[e^{-D}] = E[e^{-L}] in the cell. The resulting discrete
  pair dominates the true one (g(y) = (1 - e^{eps-y})_+ is convex in e^{-y}), so delta computed
  from the composition of the discrete steps is an *upper* bound for any number of steps, with a
  bias of only ~T h^2/8 (no mean-shift quadrature, whose error would grow like T).
* **Lower bound.** The split is a coupling with D - L in an interval of length h and mean in
  [0, beta(h)], beta ~ h^2/8. Hoeffding gives sum L >= sum D - T beta - h sqrt(T log(1/eta)/2)
  except with probability eta; delta at the shifted epsilon minus eta is a lower bound.
* **Composition.** Spectra (rfft) raised to the counts and multiplied. The low band, where
  F ~ 1 and an FFT's round-off would be amplified count-fold by the power, is computed directly
  (``_low_log_spectrum``); the other coefficients carry a per-coefficient round-off bound. The
  composed pmf is read from a window of the circular result placed by a Chernoff bound on the
  discrete steps' exact moment generating functions. The mass that can leave the window, the
  per-step truncated tails, FFT round-off and the round-off of the split are all bounded and
  absorbed into ``lower``/``upper``.
* **Smoothness.** Each grid mass is spread uniformly over its cell (shift 0 for the estimate,
  +h/2 for the upper bound, -h/2 for the lower), so delta(eps) is C^1 in eps and in every
  parameter; epsilon(delta) is its inverse with implicit gradients.

Grid sizes are static (an accuracy ``Plan``); the grid step, windows and all parameters are
arrays, so one compiled function serves a sweep.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxacct import results
from jaxacct._numerics import (F64_EPS, LOSS_BIG, array_namespace, fast_jit, float64,
                               hockey_primitive, scoped_gradients)
from jaxacct._solver import implicit_root, newton_in_bracket
from jaxacct.composition import Composition
from jaxacct.results import Bounds

# Chernoff tilts used to place the composed window and bound the mass outside it.
_TILTS = np.geomspace(1e-2, 1e3, 48)
# Assumed worst relative error of a computed CDF/SF value, in ulps (special functions + mixing).
_CDF_ULPS = 64.0
# Constant in the FFT round-off bound ||err||_2 <= c eps (ops) ||f||_2.
_FFT_ULPS = 8.0
# Largest span of loss values a grid may cover (keeps e^{+-span} finite in float64).
_MAX_SPAN = 600.0


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
  # Spectrum coefficients k < low_frequencies are computed directly (see _low_log_spectrum) from
  # block moments over blocks of ``block`` grid points.
  low_frequencies: int = dataclasses.field(default=1, metadata=dict(static=True))
  block: int = dataclasses.field(default=1, metadata=dict(static=True))
  # Spectrum coefficients k >= band are dropped when provably negligible (see _high_band).
  band: int = dataclasses.field(default=0, metadata=dict(static=True))

  def __post_init__(self):
    if not self.low_frequencies <= self.band <= self.fft_size // 2 + 1:
      object.__setattr__(self, "band", self.fft_size // 2 + 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Step:
  pmf: jax.Array        # [M] dominating discrete masses at (start + i) h
  start: jax.Array      # int64 grid index of pmf[0]
  log_finite: jax.Array  # log P(D finite)
  tail: jax.Array       # P(L outside the grid), lost by the lower bound's coupling
  moved: jax.Array      # P(round-off guard moved mass up a cell)
  bias: jax.Array       # E[D] - E[L*], the split's upward bias (removed from the estimate)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrivacyLossDistribution:
  """A composed PLD for each adjacency direction (leading axis), ready for many queries.

  Compose once, then ask ``epsilon(delta)`` and ``delta(epsilon)`` as often as needed, and
  ``append`` further steps as training goes on. All fields are arrays (a pytree).
  """

  pmf: jax.Array           # [D, N] composed masses at (start + i) h
  start: jax.Array         # [D] int64 grid index of pmf[:, 0]
  window_above: jax.Array  # [D] bound on the composed mass above the window
  window_below: jax.Array  # [D] bound on the composed mass below the window
  fft_error: jax.Array     # [D] bound on sum |FFT round-off| of the pmf
  status: jax.Array        # [D] int32 status bits
  # Running sums over the composed steps (what ``append`` extends):
  spectrum: jax.Array      # [D, N//2+1] product of the steps' FFT spectra (powers by squaring)
  low_log: jax.Array       # [D, K0] sum of count * log F'_k for k < K0 (accurate low band)
  low_error: jax.Array     # [D, K0] relative round-off bound of exp(low_log)
  low_ok: jax.Array        # [D, K0] bool: the direct value is used (every step had |z| <= 1/2)
  phase: jax.Array         # [D] int64 sum of count * centre: F_k = w^(phase k) exp(low_log_k)
  spectrum_error: jax.Array  # [D, N//2+1] relative round-off bound of each composed coefficient
  high_log: jax.Array      # [D] sum of count * log max_{k >= band} |F_k| (see _high_band)
  mass_error: jax.Array    # [D] relative round-off of the total mass (scales delta)
  base: jax.Array          # [D] int64 grid index of position 0 of the circular result
  cgf: jax.Array           # [D, 2, K] log-MGF of the discrete sum at +-tilts
  log_finite: jax.Array    # [D] log P(sum finite)
  tail: jax.Array          # [D] sum of per-step truncated tail masses
  moved: jax.Array         # [D] expected number of round-off guard moves (Poisson mean)
  bias: jax.Array          # [D] total upward bias of the split (the estimate removes it)
  total_count: jax.Array   # [D] number of composed steps
  plan: Plan

  @float64
  def epsilon(self, delta) -> Bounds:
    """Certified epsilon(delta), worst direction. ``delta`` may be an array (vectorised).

    Inputs are not checked here (this runs under tracing too): 0 < delta < 1.
    """
    return _epsilon_jit(self, delta)

  @float64
  def delta(self, epsilon) -> Bounds:
    """Certified delta(epsilon), worst direction. ``epsilon`` may be an array."""
    return _delta_jit(self, epsilon)

  @float64
  def append(self, composition: Composition) -> "PrivacyLossDistribution":
    """The PLD after further steps, on the same plan (no recomposition of earlier steps)."""
    composition.check()
    return _append_jit(self, composition)


# ----------------------------------------------------------------------------------------------
# Discretisation of one step


def _cell_masses(cdf, sf):
  """Mass of each grid cell (t_i, t_{i+1}], accurate in both tails and smooth in parameters.

  Blends the SF and CDF differences with weight w = CDF(t_i): in the right tail (w ~ 1) the SF
  difference is the accurate one, in the left tail the CDF difference. A hard switch between the
  two would move with the parameters and make the pmf jump by the round-off between them (which
  the split amplifies to ~1e-10 relative), i.e. kinks in delta and noise in finite differences.
  Returns the masses and the magnitude of the differenced values (for round-off bounds).
  """
  xp = array_namespace(cdf, sf)
  w = xp.clip(cdf[..., :-1], 0.0, 1.0)
  mass = w * (sf[..., :-1] - sf[..., 1:]) + (1.0 - w) * (cdf[..., 1:] - cdf[..., :-1])
  scale = w * sf[..., :-1] + (1.0 - w) * cdf[..., 1:]
  return xp.maximum(mass, 0.0), scale


def _split(cdf_sf, t, h, guard_ulps):
  """Connect-the-dots split of the cells (t_i, t_{i+1}] of grids t [..., M] (the accountant's
  step, or a batch of the planner's coarse grids).

  Each cell's P-mass goes to its ends so that E[e^{-D}] = E[e^{-L}], the lower end's share reduced
  by a round-off guard of ``guard_ulps`` ulps of the differenced CDF values (mass only moves up);
  the mass below the grid joins point 0. Returns the pmf on the M points and, per cell, the P-mass,
  the mass sent to the lower end and the guard.
  """
  p_cdf, p_sf, q_cdf, q_sf = cdf_sf
  xp = array_namespace(p_cdf, t, h)
  p_cell, p_scale = _cell_masses(p_cdf, p_sf)
  q_cell, q_scale = _cell_masses(q_cdf, q_sf)
  exp_b = xp.exp(xp.minimum(t[..., 1:], _MAX_SPAN))
  denom = xp.expm1(h)
  # Mass sent to the lower end a: E_P[(e^{-L} - e^{-b}) / (e^{-a} - e^{-b})] over the cell.
  to_lower = (exp_b * q_cell - p_cell) / denom
  guard = guard_ulps * F64_EPS * (exp_b * q_scale + p_scale) / denom
  to_lower = xp.clip(to_lower - guard, 0.0, p_cell)
  # Lower ends receive to_lower, upper ends the rest of the cell.
  zero = xp.zeros(p_cell.shape[:-1] + (1,))
  pmf = (xp.concatenate([to_lower, zero], axis=-1)
         + xp.concatenate([p_cdf[..., :1], p_cell - to_lower], axis=-1))
  return pmf, p_cell, to_lower, guard


def _discretise(model, add, plan: Plan) -> _Step:
  """Dominating connect-the-dots masses of one step on M grid points."""
  h = jax.lax.stop_gradient(plan.grid_step)
  size = plan.per_step_size
  lo, hi = model.loss_range(jax.lax.stop_gradient(plan.log_tail), add)
  lo = jax.lax.stop_gradient(jnp.clip(lo, -LOSS_BIG / 2, LOSS_BIG / 2))
  start = jnp.floor(lo / h).astype(jnp.int64) - 1  # t_0 < lo: P(L <= t_0) is truly tail mass
  t = (start + jnp.arange(size)).astype(jnp.float64) * h
  # The grid ends at the range's top (not wherever the static size reaches), so the planning
  # pass and this one agree on the support; the mass above goes to +inf like any truncated tail.
  top = jax.lax.stop_gradient(jnp.ceil(jnp.clip(hi, -LOSS_BIG / 2, LOSS_BIG / 2) / h) * h)
  cdf_sf = model.cdf_sf(jnp.minimum(t, top), add)
  p_cdf, p_sf = cdf_sf[:2]
  pmf, p_cell, to_lower_safe, guard = _split(cdf_sf, t, h, _CDF_ULPS)
  denom = jnp.expm1(h)
  p_inf = model.inf_mass(add)
  # Finite mass above the grid is sent to +inf (pessimistic).
  log_finite = jnp.log1p(-jnp.minimum(p_sf[-1], 1.0))
  tail = p_cdf[0] + jnp.maximum(p_sf[-1] - p_inf, 0.0)
  moved = jnp.sum(jnp.minimum(2.0 * guard, p_cell))
  # Bias of the split against the cell's exponential mean l* = -log(Q/P) (Jensen: l* <= E[L|cell],
  # within ~h^2/24): with u = b - l*, E[D | cell] - l* = u - h expm1(u)/expm1(h) >= 0.
  has_mass = p_cell > 1e-120  # (below, p^2 underflows in the derivative of x/p; no bias there)
  u = jnp.log1p(to_lower_safe * denom / jnp.where(has_mass, p_cell, 1.0))
  bias = jnp.sum(jnp.where(has_mass, p_cell * (u - h * jnp.expm1(u) / denom), 0.0))
  return _Step(pmf, start, log_finite, jax.lax.stop_gradient(tail), jax.lax.stop_gradient(moved),
               bias)


_CGF_BLOCK = 32  # grid points per block in _grid_cgf


def _grid_cgf(pmf, start, h):
  """log sum_i pmf_i e^{lambda (start + i) h} at lambda = +-_TILTS: [..., 2, K] for pmfs [..., M]
  (a batch on the host; one step in JAX, with scalar start and h).

  Blocks of _CGF_BLOCK points: sum_r p_{J,r} e^{lambda h (r - c)} is a matrix product with a
  small table (c the block centre), then a log-sum-exp over blocks. A tilt whose table would
  leave float64 range is given cgf = +inf, which only makes its Chernoff bound vacuous.
  """
  xp = array_namespace(pmf, start, h)
  batch, size = pmf.shape[:-1], pmf.shape[-1]
  blocks = -(-size // _CGF_BLOCK)
  pmf = xp.concatenate([xp.maximum(pmf, 0.0), xp.zeros(batch + (blocks * _CGF_BLOCK - size,))],
                       axis=-1)
  centre = 0.5 * (_CGF_BLOCK - 1)
  tilts = np.concatenate([_TILTS, -_TILTS])
  h = h[..., None, None]
  exponent = tilts[:, None] * h * (np.arange(_CGF_BLOCK) - centre)                 # [..., 2K, b]
  in_range = _TILTS * h[..., 0] * centre <= 600.0
  table = xp.exp(xp.clip(exponent, -700.0, 700.0))
  sums = pmf.reshape(batch + (blocks, _CGF_BLOCK)) @ xp.swapaxes(table, -1, -2)  # [..., B, 2K]
  block_centres = (start[..., None, None] + np.arange(blocks)[:, None] * _CGF_BLOCK + centre) * h
  log_terms = xp.log(sums) + tilts * block_centres
  peak = xp.max(log_terms, axis=-2, keepdims=True)
  peak = xp.where(xp.isfinite(peak), peak, 0.0)
  cgf = peak[..., 0, :] + xp.log(xp.sum(xp.exp(log_terms - peak), axis=-2))
  cgf = cgf.reshape(batch + (2, len(_TILTS)))
  return xp.where(in_range[..., None, :], cgf, xp.inf)


def _step_cgf(step: _Step, h):
  """log E[e^{lambda D}; D finite] at +-_TILTS (exact, for the discrete step)."""
  return jax.lax.stop_gradient(_grid_cgf(step.pmf, step.start, h))


# ----------------------------------------------------------------------------------------------
# Composition

_TAYLOR_TERMS = 9  # block moments 0..8: the in-block expansion of e^{-i theta r} errs < 1e-17


def _low_log_spectrum(pmf, n, k0, block):
  """log F'_k for k < k0, where F_k = w^(c k) F'_k (w = e^{-2 pi i/n}, c the rounded mean index).

  An FFT computes F_k to an absolute error ~ eps; composing T steps raises F_k to the power T, and
  where F_k is close to 1 (the low frequencies, which carry the composed distribution) that error
  becomes a relative error ~T eps / (1 - |F_k|) of the composed spectrum: enough to move delta by
  1e-5 relative at T = 1e5. Here A_k = S - F'_k is accumulated from terms that are each accurate
  relative to their own size (1 - e^{-ix} as 2 sin^2(x/2) + i sin x), so log F'_k = log S +
  log1p(-A_k/S) has a relative error ~eps and T log F'_k stays accurate. Positions are grouped in
  blocks of ``block`` points, inside which e^{-i theta r} is expanded to order 8 (theta block <=
  0.05), so the cost is (M / block) * k0 rather than M * k0, done in chunks of frequencies so
  that memory stays within a few arrays of the FFT's length.
  """
  m = pmf.shape[0]
  blocks = -(-m // block)
  padded = jnp.concatenate([pmf, jnp.zeros(blocks * block - m)]).reshape(blocks, block)
  r = jnp.arange(block, dtype=jnp.float64)
  p = np.arange(_TAYLOR_TERMS)
  factorials = np.array([math.factorial(j) for j in p], dtype=np.float64)
  powers = r[None, :] ** p[:, None] / factorials[:, None]       # r^p / p!
  moments = padded @ powers.T                                   # [blocks, P]
  total = jnp.sum(moments[:, 0])
  index = jnp.arange(m, dtype=jnp.float64)
  centre = jax.lax.stop_gradient(jnp.round(jnp.sum(pmf * index) / total))
  offsets = jnp.arange(blocks, dtype=jnp.float64) * block - centre   # block start - centre
  theta = (2.0 * math.pi / n) * jnp.arange(k0, dtype=jnp.float64)     # [k0]
  # Real and imaginary parts of (-i)^p for p = 1..8 (the rows of one matrix product).
  signs = np.stack([np.where(p[1:] % 2 == 0, (-1.0) ** (p[1:] // 2), 0.0),
                    np.where(p[1:] % 2 == 1, -((-1.0) ** (p[1:] // 2)), 0.0)])   # [2, P-1]

  def log_spectrum(freqs):  # [c] angular frequencies -> (log F'_k, |z_k|)
    x = freqs[:, None] * offsets[None, :]                        # [c, blocks]
    half = jnp.sin(0.5 * x)
    one_minus_re, one_minus_im = 2.0 * half * half, jnp.sin(x)   # 1 - e^{-ix}
    cos_x, sin_x = 1.0 - one_minus_re, one_minus_im              # e^{-ix} = cos x - i sin x
    # sum_{p>=1} (-i theta)^p moment_p: real parts from even p, imaginary from odd p.
    coef = freqs[:, None, None] ** p[1:] * signs                 # [c, 2, P-1]
    taylor = coef @ moments[:, 1:].T                              # [c, 2, blocks]
    taylor_re, taylor_im = taylor[:, 0], taylor[:, 1]
    # A_k = sum_J [ m0_J (1 - e^{-ix}) - e^{-ix} taylor_J ]
    a_re = jnp.sum(moments[None, :, 0] * one_minus_re - (cos_x * taylor_re + sin_x * taylor_im),
                   1)
    a_im = jnp.sum(moments[None, :, 0] * one_minus_im - (cos_x * taylor_im - sin_x * taylor_re),
                   1)
    zr, zi = a_re / total, a_im / total
    # |1 - z|^2 - 1 >= -1; the clamp only keeps rounding (where |z| ~ 1 and the value is not
    # used, see _LOW_BAND_MAX_Z) from giving NaNs.
    log_abs = jnp.log(total) + 0.5 * jnp.log1p(jnp.maximum(-2.0 * zr + zr * zr + zi * zi,
                                                           -1.0 + 1e-300))
    return log_abs + 1j * jnp.arctan2(-zi, 1.0 - zr), jnp.hypot(zr, zi)

  # The [frequencies, blocks] arrays stay within the FFT's own size: a plan that serves a wide
  # sweep (finest grid of one setting, widest window of another) can have k0 x blocks >> n.
  chunk = max(1, n // blocks)
  if k0 <= chunk:
    log_f, deviation = log_spectrum(theta)
  else:
    chunks = -(-k0 // chunk)
    padded_theta = jnp.concatenate([theta, jnp.zeros(chunks * chunk - k0)])
    log_f, deviation = jax.lax.map(log_spectrum, padded_theta.reshape(chunks, chunk))
    log_f, deviation = log_f.reshape(-1)[:k0], deviation.reshape(-1)[:k0]
  return log_f, centre.astype(jnp.int64), deviation


_TINY = 1e-150  # spectrum values below this count as 0 (their powers are below 1e-150)
# A low-band coefficient is taken from the direct sums only where every step has |z| <= this
# (|F'_k| >= S/2, so 1 - z keeps its relative accuracy); elsewhere the FFT value is used.
_LOW_BAND_MAX_Z = 0.5


def _power(transform, count):
  """transform ** count for an integer-valued count, as exp(count log F).

  Where |F| < _TINY the power is set to 0 (keeping gradients finite; the errata's objection to
  exp(k log F) is NaN gradients where F underflows). Its round-off, count x (relative error of F)
  + eps |count log F|, is bounded per coefficient in ``spectrum_error``; the low band, where that
  error would be amplified, is replaced by ``_low_log_spectrum``.
  """
  keep = jnp.abs(transform) > _TINY
  safe = jnp.where(keep, transform, 1.0)
  powered = jnp.where(keep, jnp.exp(count * jnp.log(safe)), 0.0)
  return jnp.where(count == 0, 1.0 + 0j, powered)


def _rotation(phase, k, n):
  """w^(phase k) = exp(-2 pi i ((phase k) mod n) / n), with the product reduced exactly."""
  turns = jnp.mod(jnp.mod(phase, n) * k, n).astype(jnp.float64) / n
  return jnp.exp(-2j * math.pi * turns)


def _coefficient_error(transform, count, fft_abs):
  """Relative round-off bound of transform ** count: the FFT's absolute error (~eps log2(n)
  ||pmf||_2 per coefficient) relative to |F_k|, times the count, plus the power's own rounding.
  (The rounding of the total mass is a common factor, kept apart in ``mass_error``.)"""
  magnitude = jnp.maximum(jnp.abs(transform), _TINY)
  return count * (fft_abs / magnitude + F64_EPS * (1.0 + jnp.abs(jnp.log(magnitude))))


def _accumulate(composition: Composition, add, plan: Plan):
  """Spectrum product on the band k < plan.band and bookkeeping for one direction.

  Returns the running sums and, per step, (transform, count, fft_abs) for ``_high_band``.
  """
  n, k0, k1 = plan.fft_size, plan.low_frequencies, plan.band
  h = jax.lax.stop_gradient(plan.grid_step)
  band = jnp.ones(k1, dtype=jnp.complex128)
  band_error = jnp.zeros(k1)
  high_log = jnp.zeros(())
  low_log = jnp.zeros(k0, dtype=jnp.complex128)
  low_error = jnp.zeros(k0)
  low_ok = jnp.ones(k0, dtype=bool)
  phase = jnp.zeros((), jnp.int64)
  mass_error = jnp.zeros(())
  log2n = math.log2(n)
  base = jnp.zeros((), jnp.int64)
  cgf = jnp.zeros((2, len(_TILTS)))
  log_finite = tail = moved = bias = total = jnp.zeros(())
  steps = []
  for mech, count in zip(composition.mechanisms, composition.counts):
    count = jnp.round(jnp.asarray(count, dtype=jnp.float64))
    k = count.astype(jnp.int64)
    step = _discretise(mech, add, plan)
    transform = jnp.fft.rfft(step.pmf, n=n)
    fft_abs = _FFT_ULPS * F64_EPS * log2n * jnp.sqrt(jnp.sum(step.pmf ** 2))
    steps.append((transform, count, jax.lax.stop_gradient(fft_abs)))
    band = band * _power(transform[:k1], count)
    if k1 < n // 2 + 1:  # log of the largest |F_k|^count above the band
      largest = jnp.max(jnp.abs(jax.lax.stop_gradient(transform[k1:])))
      high_log = high_log + count * jnp.log(jnp.maximum(largest, _TINY))
    step_log, centre, deviation = _low_log_spectrum(step.pmf, n, k0, plan.block)
    low_log = low_log + count * step_log
    low_ok = low_ok & ((deviation <= _LOW_BAND_MAX_Z) | (count == 0))
    phase = phase + k * centre
    # In the low band, the direct sums' relative error times the count.
    theta_block = (2.0 * math.pi * (plan.block - 1) / n) * jnp.arange(k0)  # largest theta r
    low_error = low_error + jax.lax.stop_gradient(
        count * (256.0 * F64_EPS * deviation + theta_block ** _TAYLOR_TERMS / 362880.0))
    band_error = band_error + jax.lax.stop_gradient(
        _coefficient_error(transform[:k1], count, fft_abs))
    mass_error = mass_error + count * _FFT_ULPS * F64_EPS
    base = base + k * step.start
    # (A count of 0 adds nothing, also at tilts whose MGF is +inf on a coarse grid.)
    cgf = cgf + jnp.where(count > 0, count * _step_cgf(step, h), 0.0)
    log_finite = log_finite + count * step.log_finite
    tail = tail + count * step.tail
    moved = moved + count * step.moved
    bias = bias + count * step.bias
    total = total + count
  acc = dict(spectrum=band, low_log=low_log, low_error=low_error, low_ok=low_ok, phase=phase,
             spectrum_error=band_error,
             high_log=high_log, mass_error=mass_error, base=base, cgf=cgf,
             log_finite=log_finite, tail=tail, moved=moved, bias=bias, total_count=total)
  return acc, steps


def _high_band_negligible(high_log, plan: Plan):
  """Whether the composed spectrum above the band may be dropped: its contribution to the summed
  pmf error, sqrt(2 (n/2 + 1 - band)) max|F_k|, is below the window's tail level."""
  n_high = plan.fft_size // 2 + 1 - plan.band
  return high_log + 0.5 * math.log(2.0 * max(n_high, 1)) <= plan.log_window_tail


def _high_band(acc, steps, plan: Plan, previous=None):
  """Completes ``acc`` (leading direction axis) with the spectrum above the band.

  At large counts the composed spectrum above a small band is below any float64 concern: then
  the band's powers are all that is computed (the dropped part is bounded in ``_materialise``);
  otherwise every coefficient is powered. One branch runs (a select under an outer ``vmap``).
  ``previous`` holds the running sums of a PLD being appended to.
  """
  n, k1 = plan.fft_size, plan.band
  if previous is not None:
    acc["high_log"] = acc["high_log"] + previous["high_log"]
  if k1 == n // 2 + 1:
    return acc

  def dropped():
    shape = acc["spectrum"].shape[:-1] + (n // 2 + 1 - k1,)
    return jnp.zeros(shape, jnp.complex128), jnp.zeros(shape)

  def computed():
    spectrum = jnp.ones_like(steps[0][0][..., k1:])
    error = jnp.zeros(spectrum.shape)
    for transform, count, fft_abs in steps:
      count_ = count[..., None]
      spectrum = spectrum * _power(transform[..., k1:], count_)
      error = error + jax.lax.stop_gradient(
          _coefficient_error(transform[..., k1:], count_, fft_abs[..., None]))
    if previous is not None:
      spectrum = spectrum * previous["spectrum"][..., k1:]
      error = error + previous["spectrum_error"][..., k1:]
    return spectrum, error

  negligible = jnp.all(_high_band_negligible(acc["high_log"], plan))
  spectrum, error = jax.lax.cond(negligible, dropped, computed)
  acc["spectrum"] = jnp.concatenate([acc["spectrum"], spectrum], axis=-1)
  acc["spectrum_error"] = jnp.concatenate([acc["spectrum_error"], error], axis=-1)
  return acc


def _window_edges(cgf, log_level):
  """Chernoff: the composed sum lies in [bottom, top] but for exp(log_level) mass on each side,
  from its log-MGF ``cgf`` at +-_TILTS."""
  xp = array_namespace(cgf, log_level)
  return (xp.max(-(cgf[..., 1, :] - log_level) / _TILTS, axis=-1),
          xp.min((cgf[..., 0, :] - log_level) / _TILTS, axis=-1))


def _materialise(acc, plan: Plan):
  """Composed pmf on its window and the certificates for what the window leaves out."""
  n = plan.fft_size
  h = jax.lax.stop_gradient(plan.grid_step)
  tilts = jnp.asarray(_TILTS)
  cgf_pos, cgf_neg = acc["cgf"][0], acc["cgf"][1]
  level = plan.log_window_tail
  bottom_needed, top_needed = _window_edges(acc["cgf"], level)
  needed = jnp.ceil((top_needed - bottom_needed) / h).astype(jnp.int64) + 1
  fits = needed <= n
  start = jnp.where(fits, jnp.floor(bottom_needed / h).astype(jnp.int64) - (n - needed) // 2,
                    jnp.ceil(top_needed / h).astype(jnp.int64) - n + 1)
  top = (start + n).astype(jnp.float64) * h
  bottom = (start - 1).astype(jnp.float64) * h
  above = jnp.exp(jnp.minimum(0.0, jnp.min(cgf_pos - tilts * top)))
  below = jnp.exp(jnp.minimum(0.0, jnp.min(cgf_neg + tilts * bottom)))
  k0 = plan.low_frequencies
  low = jnp.exp(acc["low_log"]) * _rotation(acc["phase"], jnp.arange(k0), n)
  ok = acc["low_ok"]
  spectrum = acc["spectrum"].at[:k0].set(jnp.where(ok, low, acc["spectrum"][:k0]))
  relative_error = acc["spectrum_error"].at[:k0].set(
      jnp.where(ok, acc["low_error"], acc["spectrum_error"][:k0]))
  circular = jnp.fft.irfft(spectrum, n=n)
  pmf = jnp.roll(circular, -jnp.mod(start - acc["base"], n))
  # Round-off: sum_j |err_j| <= sqrt(n) ||err||_2 = ||spectrum error||_2 (Parseval, both halves),
  # plus the inverse transform's own error c eps log2(n) sqrt(n) ||f||_2.
  coefficient_error = jnp.abs(spectrum) * relative_error
  # A spectrum dropped above the band (see _high_band) adds at most its own L2 bound.
  n_high = max(n // 2 + 1 - plan.band, 1)
  dropped = jnp.where(_high_band_negligible(acc["high_log"], plan),
                      jnp.exp(acc["high_log"] + 0.5 * math.log(2.0 * n_high)), 0.0)
  fft_error = (math.sqrt(2.0) * jnp.sqrt(jnp.sum(coefficient_error ** 2)) + dropped
               + _FFT_ULPS * F64_EPS * (math.log2(n) + 8.0) * math.sqrt(n)
               * jnp.sqrt(jnp.sum(pmf * pmf)))
  status = jnp.where(fits, results.OK, results.WINDOW_TOO_SMALL).astype(jnp.int32)
  return dict(pmf=pmf, start=start, window_above=above, window_below=below,
              fft_error=jax.lax.stop_gradient(fft_error), status=status)


def _directions(composition: Composition):
  """Direction flags to compose: remove only for symmetric lists, else remove and add."""
  return np.array([0.0] if composition.symmetric else [0.0, 1.0])


def compose(composition: Composition, plan: Plan) -> PrivacyLossDistribution:
  """Composed PLD of ``composition`` for each adjacency direction (pure; jit/vmap-able)."""
  acc, steps = jax.vmap(_accumulate, in_axes=(None, 0, None))(
      composition, _directions(composition), plan)
  acc = _high_band(acc, steps, plan)
  return PrivacyLossDistribution(plan=plan, **acc, **jax.vmap(_materialise, (0, None))(acc, plan))


_RUNNING_SUMS = ("low_log", "low_error", "phase", "spectrum_error", "high_log", "mass_error",
                 "base",
                 "cgf", "log_finite", "tail", "moved", "bias", "total_count")


def append(pld: PrivacyLossDistribution, composition: Composition) -> PrivacyLossDistribution:
  """``pld`` followed by ``composition``: multiplies spectra, adds the running sums."""
  n_dir = pld.pmf.shape[0]
  if _directions(composition).shape[0] > n_dir:
    raise ValueError("cannot append an asymmetric mechanism to a PLD composed in one direction; "
                     "compose the whole list instead")
  k1 = pld.plan.band
  acc, steps = jax.vmap(_accumulate, in_axes=(None, 0, None))(
      composition, jnp.array([0.0, 1.0][:n_dir]), pld.plan)
  previous = {key: getattr(pld, key) for key in ("spectrum",) + _RUNNING_SUMS}
  for key in _RUNNING_SUMS:
    if key not in ("spectrum_error", "high_log"):
      acc[key] = acc[key] + previous[key]
  acc["low_ok"] = acc["low_ok"] & pld.low_ok
  acc["spectrum"] = acc["spectrum"] * previous["spectrum"][:, :k1]
  acc["spectrum_error"] = acc["spectrum_error"] + previous["spectrum_error"][:, :k1]
  acc = _high_band(acc, steps, pld.plan, previous)
  return PrivacyLossDistribution(plan=pld.plan, **acc,
                                 **jax.vmap(_materialise, (0, None))(acc, pld.plan))


# ----------------------------------------------------------------------------------------------
# Queries


def _coupling_bias(h):
  """beta(h): the largest mean of D - L under the connect-the-dots coupling on a cell of width h.

  With y = h / (1 - e^{-h}) it is y - 1 - log y (about h^2/8).
  """
  u = h / -jnp.expm1(-h) - 1.0
  return u - jnp.log1p(u)


def _guard_moves(mean, eta):
  """Smallest m with P(X > m) <= eta for X a sum of independent Bernoullis with mean ``mean``.

  Chernoff: P(X >= j) <= exp(-mean) (e mean / j)^j for j > mean. Infinite if no m < 4096 works.
  """
  m = jnp.arange(4096.0)
  j = m + 1.0
  safe_mean = jnp.maximum(mean, 1e-300)
  log_tail = jnp.where(j > mean, -mean + j * (1.0 + jnp.log(safe_mean) - jnp.log(j)), 0.0)
  log_tail = jnp.where(mean > 0.0, log_tail, -jnp.inf)
  # The bound decreases in j once j > mean, so the failing m are a prefix: count them.
  failing = jnp.sum(~(log_tail <= jnp.log(eta)))  # (a NaN eta fails every m: infinite)
  return jnp.where(failing < m.shape[0], failing.astype(jnp.float64), jnp.inf)


def _delta_on_grid(pmf, first_centre, h, eps):
  """sum_i pmf_i * mean of (1 - e^{eps - y})_+ over y in [c_i - h/2, c_i + h/2] (finite part)."""
  centres = first_centre + jnp.arange(pmf.shape[0]) * h
  upper = hockey_primitive(centres + 0.5 * h - eps)
  lower = hockey_primitive(centres - 0.5 * h - eps)
  return jnp.sum(pmf * (upper - lower)) / h


_TAIL_BLOCK = 512  # grid points per block of the two-level tail sums
_TRIANGLE_MAX = 2048  # longest axis whose suffix sums are a product with a triangular matrix


def _suffix_sums(x):
  """sum_{j >= i} x_j along the last axis. Up to _TRIANGLE_MAX values as a product with a
  triangular 0/1 matrix (one library call; ``jnp.cumsum`` compiles to a dozen kernels on CPU),
  beyond that (block sums of a huge grid) as a reversed cumulative sum."""
  n = x.shape[-1]
  if n > _TRIANGLE_MAX:
    return jnp.flip(jnp.cumsum(jnp.flip(x, -1), -1), -1)
  upper = (jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]).astype(x.dtype)  # [j, i]: j >= i
  return x @ upper


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _TailSums:
  """Tail sums of a pmf, two-level: the cell where delta crosses a target in O(B^2 + N / B)
  (one row of B boundaries summed by a triangular product) after O(N) preparation.

  With rel_b = (b - N/2) h and scaled_j = pmf_j e^{-rel_j}, the delta of the grid pmf (masses
  spread over their cells) at the boundary b (left edge of cell b) is
  d(b) = sum_{j >= b} pmf_j - c e^{rel_b} sum_{j >= b} scaled_j,  c = (1 - e^{-h}) / h.
  (pmf and scaled are stacked, so that each lookup is one gather and one matrix product.)
  """

  rows: jax.Array   # [blocks, 2, B] pmf and scaled, zero padded
  after: jax.Array  # [2, blocks + 1] their sums over blocks >= J
  h: jax.Array
  n: int = dataclasses.field(metadata=dict(static=True))  # N, the unpadded length

  @staticmethod
  def of(pmf, h):
    n = pmf.shape[0]
    block = min(_TAIL_BLOCK, n)
    blocks = -(-n // block)
    rel = (jnp.arange(n) - n // 2).astype(jnp.float64) * h
    both = jnp.stack([pmf, pmf * jnp.exp(-rel)])                          # [2, N]
    rows = jnp.pad(both, ((0, 0), (0, blocks * block - n))).reshape(2, blocks, block)
    after = jnp.pad(_suffix_sums(jnp.sum(rows, 2)), ((0, 0), (0, 1)))
    return _TailSums(jnp.swapaxes(rows, 0, 1), after, h, n)

  def _weight(self, b):
    """c e^{rel_b}: d(b) = mass(b) - c e^{rel_b} scaled(b)."""
    rel = (b - self.n // 2).astype(jnp.float64) * self.h
    return -jnp.expm1(-self.h) / self.h * jnp.exp(rel)

  def delta_at_start(self):
    """(total mass, d(0))."""
    total, scaled = self.after[:, 0]
    return total, total - self._weight(jnp.zeros((), jnp.int64)) * scaled

  def crossing(self, target):
    """The cell where d falls to ``target`` (d is non-increasing up to round-off): the first
    boundary k with d(k) <= target (a count over block starts, then over one block's
    boundaries); the cell i = max(k - 1, 0) (up to round-off between the two counts); d at i
    and i + 1; beyond i + 1 the mass and the weighted sum c e^{rel_{i+1}} sum scaled; pmf_i."""
    blocks, _, block = self.rows.shape
    starts = jnp.arange(blocks) * block
    d_starts = self.after[0, :-1] - self._weight(starts) * self.after[1, :-1]
    j = jnp.clip(jnp.sum(d_starts > target) - 1, 0, blocks - 1)
    # Boundaries j B, ..., (j + 1) B of the row: its suffix sums plus the blocks after it.
    row = self.rows[j]                                                     # [2, B]
    mass, scaled = jnp.pad(_suffix_sums(row), ((0, 0), (0, 1))) + self.after[:, j + 1, None]
    bounds = j * block + jnp.arange(block + 1)
    weighted = self._weight(bounds) * scaled
    d = mass - weighted
    above = jnp.sum((d > target) & (bounds <= self.n))
    r = jnp.clip(above - 1, 0, block - 1)
    table = jnp.stack([d, mass, weighted, jnp.pad(row[0], (0, 1))])       # [4, B + 1]
    (d_i, d_next), (_, mass_right), (_, weighted_right), (p_i, _) = (
        jax.lax.dynamic_slice(table, (0, r), (4, 2)))
    return j * block + above, j * block + r, (d_i, d_next), mass_right, weighted_right, p_i


def _epsilon_on_grid(pmf, sums: _TailSums, first_centre, h, target, side):
  """Root of delta_grid(eps) = target; ``side`` +1 (-1) returns a point where delta <= target
  (>= target), the safe end for an upper (lower) bound. Implicit gradients via ``implicit_root``."""
  left0 = first_centre - 0.5 * h
  total, d0 = sums.delta_at_start()
  valid = target > 0.0
  tgt = jnp.where(valid, target, 0.5 * d0 + 1e-300)  # any positive placeholder

  def solve(_, __):
    k, i, (d_i, d_next), mass_right, weighted_right, p_i = sums.crossing(tgt)
    a = left0 + i * h
    b = a + h

    def local(x):  # delta_grid(x) - target and its slope, for x in cell i
      tilt = jnp.exp(x - b) * weighted_right
      value = mass_right - tilt + p_i * hockey_primitive(b - x) / h - tgt
      return value, -tilt + p_i * jnp.expm1(x - b) / h

    frac = jnp.clip((d_i - tgt) / jnp.maximum(d_i - d_next, 1e-300), 0.0, 1.0)
    # 12 steps: with 6, ~3% of the roots on a fine delta sweep were still unconverged (the
    # safeguard had bisected), so the bounds were valid but not monotone in delta.
    x, *_ = newton_in_bracket(local, a, b, a + frac * h, iters=12)
    fx, dfx = local(x)
    slack = 4.0 * F64_EPS * (1.0 + jnp.abs(x))
    step = jnp.abs(fx / jnp.where(dfx < 0.0, dfx, -1.0))
    safe_up = jnp.minimum(jnp.where(fx > 0.0, x + 2.0 * step, x) + slack, b)
    safe_down = jnp.maximum(jnp.where(fx < 0.0, x - 2.0 * step, x) - slack, a)
    x = jnp.where(side > 0, safe_up, jnp.where(side < 0, safe_down, x))
    # Below the window every cell lies to the right: delta = total - e^{eps - left0} (total - d0).
    # Its logs carry the round-off of the differences, moved to the safe side like x's.
    below = left0 + jnp.log(jnp.maximum(total - tgt, 0.0)) - jnp.log(total - d0)
    below_slack = 4.0 * F64_EPS * (1.0 + jnp.abs(below) + total / jnp.maximum(total - tgt, 1e-300)
                                   + total / jnp.maximum(total - d0, 1e-300))
    below = jnp.where(jnp.isfinite(below), below + side * below_slack, below)  # side: -1, 0, +1
    return jnp.where(k == 0, below, x)

  def residual(x):
    return _delta_on_grid(pmf, first_centre, h, x) - target

  eps = implicit_root(residual, solve, jnp.zeros(()))
  return jnp.where(valid, eps, jnp.inf)


_SHIFTS = np.array([-0.5, 0.0, 0.5])  # lower, estimate, upper: where each cell's mass is spread
_ESTIMATE = np.array([0.0, 1.0, 0.0])  # only the estimate is de-biased


def _lower_shift(view, plan, eta, h):
  """s such that sum L >= sum D_safe - s except with probability 2 eta (see module docstring)."""
  total = view["total_count"]
  moves = _guard_moves(view["moved"], eta)
  hoeffding = h * jnp.sqrt(0.5 * total * jnp.log(1.0 / eta))
  return total * _coupling_bias(h) + hoeffding + moves * h


def _epsilon_direction(view, plan, delta):
  h = jax.lax.stop_gradient(plan.grid_step)
  pmf = view["pmf"]
  p_inf = -jnp.expm1(view["log_finite"])
  eta = plan.delta_error * delta
  scale = view["mass_error"]
  upper_target = (delta - p_inf - view["window_above"] - view["fft_error"]) / (1.0 + scale)
  lower_target = (delta - p_inf + 2.0 * eta + view["window_below"] + view["fft_error"]
                  + view["tail"]) / (1.0 - scale)
  targets = jnp.stack([lower_target, delta - p_inf, upper_target])
  centres = view["start"].astype(jnp.float64) * h + _SHIFTS * h - _ESTIMATE * view["bias"]
  sums = _TailSums.of(pmf, h)
  solve = lambda centre, target, side: _epsilon_on_grid(pmf, sums, centre, h, target, side)
  lower, estimate, upper = jax.vmap(solve)(centres, targets, jnp.sign(_SHIFTS))
  lower = lower - _lower_shift(view, plan, eta, h)
  floor = jnp.where(upper_target > 0.0, results.OK, results.BELOW_FLOOR).astype(jnp.int32)
  status = jnp.bitwise_or(view["status"].astype(jnp.int32), floor)
  clip = lambda e: jnp.maximum(e, 0.0)
  return Bounds(clip(lower), clip(estimate), clip(upper), status)


def _delta_direction(view, plan, eps):
  h = jax.lax.stop_gradient(plan.grid_step)
  pmf = view["pmf"]
  p_inf = -jnp.expm1(view["log_finite"])
  centre0 = view["start"].astype(jnp.float64) * h
  estimate = p_inf + _delta_on_grid(pmf, centre0 - view["bias"], h, eps)
  scale = view["mass_error"]
  upper = (p_inf + _delta_on_grid(pmf, centre0 + 0.5 * h, h, eps) * (1.0 + scale)
           + view["window_above"] + view["fft_error"])
  eta = plan.delta_error * jnp.maximum(estimate, 1e-300)
  shifted = eps + _lower_shift(view, plan, eta, h)
  lower = (p_inf + _delta_on_grid(pmf, centre0 - 0.5 * h, h, shifted) * (1.0 - scale) - 2.0 * eta
           - view["window_below"] - view["fft_error"] - view["tail"])
  return Bounds(jnp.clip(lower, 0.0, 1.0), jnp.clip(estimate, 0.0, 1.0),
                jnp.clip(upper, 0.0, 1.0), view["status"])


_VIEW = ("pmf", "start", "window_above", "window_below", "fft_error", "mass_error", "status",
         "log_finite", "tail", "moved", "bias", "total_count")


def _worst_direction(pld, fn, arg):
  """Runs ``fn`` on every direction (vmapped) and keeps the worse guarantee."""
  view = {key: getattr(pld, key) for key in _VIEW}
  per_direction = jax.vmap(fn, in_axes=(0, None, None))(view, pld.plan, arg)
  out = jax.tree_util.tree_map(lambda x: x[0], per_direction)
  for i in range(1, pld.pmf.shape[0]):
    out = results.worst_of(out, jax.tree_util.tree_map(lambda x: x[i], per_direction))
  return out


def epsilon_from_pld(pld: PrivacyLossDistribution, delta) -> Bounds:
  """Certified epsilon(delta) of a composed PLD; vectorised over the shape of ``delta``."""
  delta = jnp.asarray(delta, dtype=jnp.float64)
  one = lambda d: _worst_direction(pld, _epsilon_direction, d)
  return jnp.vectorize(one, signature="()->()")(delta) if delta.ndim else one(delta)


def delta_from_pld(pld: PrivacyLossDistribution, epsilon) -> Bounds:
  """Certified delta(epsilon) of a composed PLD; vectorised over the shape of ``epsilon``."""
  epsilon = jnp.asarray(epsilon, dtype=jnp.float64)
  one = lambda e: _worst_direction(pld, _delta_direction, e)
  return jnp.vectorize(one, signature="()->()")(epsilon) if epsilon.ndim else one(epsilon)


_epsilon_jit = fast_jit(scoped_gradients(epsilon_from_pld))
_delta_jit = fast_jit(scoped_gradients(delta_from_pld))
_append_jit = fast_jit(scoped_gradients(append))


# ----------------------------------------------------------------------------------------------
# Planning (host side, concrete values)


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


_PLAN_CHUNK = 256  # settings per block of the planning pass (~4 MB per [settings, points] array)


def _plan_widths(composition: Composition, log_tail, log_window_tail):
  """Per setting of a (batched) composition: widest per-step loss range, width of the composed
  window and the count-weighted mean variance of a step's loss. On the host (numpy: nothing is
  compiled; a model written with jax.numpy alone runs eagerly here), in blocks of settings.

  Each step is split as in ``_discretise`` (``_split``, without its round-off guard) on a coarse
  grid of ``_PLAN_POINTS`` points spanning its range; the window comes from the same Chernoff
  rule as in ``_materialise``. (These only size the plan: the accountant checks its own window
  and widens the plan if the composed loss outgrows it.)
  """
  host = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), composition)
  shape = np.broadcast_shapes(*[a.shape for a in jax.tree_util.tree_leaves(host)])
  host = jax.tree_util.tree_map(lambda a: np.broadcast_to(a, shape).reshape(-1, 1), host)
  blocks = [_block_widths(jax.tree_util.tree_map(lambda a: a[i:i + _PLAN_CHUNK], host),
                          _directions(composition), log_tail, log_window_tail)
            for i in range(0, math.prod(shape), _PLAN_CHUNK)]
  return tuple(np.concatenate(parts) for parts in zip(*blocks))


def _per_setting(mech, method, args):
  """``mech.method(*args_i)`` for each setting i (rows of ``args``), stacked: [settings, outputs,
  ...]. A model is called one setting at a time, as in the accountant (its parameters scalars)."""
  rows = []
  for i, row in enumerate(zip(*args)):
    one = jax.tree_util.tree_map(lambda a: a[i, 0], mech)
    rows.append(np.stack([np.broadcast_to(np.asarray(v, np.float64), np.shape(row[0]))
                          for v in getattr(one, method)(*row)]))
  return np.stack(rows)


def _block_widths(host: Composition, directions, log_tail, log_window_tail):
  """``_plan_widths`` for a block of settings (numpy leaves of shape [settings, 1])."""
  settings = jax.tree_util.tree_leaves(host)[0].shape[0]
  widest, window, variance = np.zeros(settings), np.zeros(settings), np.full(settings, np.inf)
  for add in directions:
    cgf = np.zeros((settings, 2, len(_TILTS)))
    spread = total = np.zeros((settings, 1))
    flags = np.full(settings, add)
    for mech, count in zip(host.mechanisms, host.counts):
      lo, hi = np.split(_per_setting(mech, "loss_range",
                                     (np.full(settings, log_tail), flags)), 2, axis=1)
      lo = np.clip(lo, -LOSS_BIG / 2, LOSS_BIG / 2)
      hi = np.clip(hi, lo + 1e-12, LOSS_BIG / 2)
      widest = np.maximum(widest, (hi - lo)[:, 0])
      h = np.maximum((hi - lo) / (_PLAN_POINTS - 8), 1e-9)
      start = np.floor(lo / h) - 1.0
      t = (start + np.arange(_PLAN_POINTS)) * h
      cdf_sf = np.moveaxis(_per_setting(
          mech, "cdf_sf", (np.minimum(t, np.ceil(hi / h) * h), flags)), 1, 0)
      pmf = _split(cdf_sf, t, h, guard_ulps=0.0)[0]
      step_cgf = _grid_cgf(pmf, start[:, 0], h[:, 0])
      cgf = cgf + np.where(count[:, :, None] > 0, count[:, :, None] * step_cgf, 0.0)
      weights = pmf / np.sum(pmf, axis=1, keepdims=True)
      mean = np.sum(weights * t, axis=1, keepdims=True)
      spread = spread + count * np.sum(weights * (t - mean) ** 2, axis=1, keepdims=True)
      total = total + count
    bottom, top = _window_edges(cgf, log_window_tail)
    window = np.maximum(window, top - bottom)
    variance = np.minimum(variance, (spread / np.maximum(total, 1.0))[:, 0])
  return widest, window, variance


# Static sizes (per step, fft, low band, band) planned so far in this process: a new plan reuses
# one within 2x of its grid sizes and 1-4x its bands' needs, so nearby settings share one
# compiled program. New bands get headroom: 2x for the band (it costs little), 1.25x for the low
# band (its direct sums cost ~ its square: ~5% of a warm call): one program serves a sweep of
# sigma over ~20-25% one setting at a time.
_USED_SIZES: set = set()
_LOW_HEADROOM = 1.25


def _static_sizes(per_step: int, fft: int, sd_bins: float, composed_sd_bins: float,
                  log_window_tail: float):
  """(per_step, fft, low, block, band) for the needed grid sizes: a reused set if one fits."""
  def needs(n):  # low band and band needed on an FFT of n points
    return _low_band(n, sd_bins), _band(n, composed_sd_bins, log_window_tail)

  def fits(sizes):
    m, n, low, band = sizes
    need_low, need_band = needs(n)
    return (per_step <= m <= 2 * per_step and fft <= n <= 2 * fft
            and need_low <= low <= max(4 * need_low, 16) and need_band <= band <= 4 * need_band)

  reusable = [sizes for sizes in _USED_SIZES if fits(sizes)]
  if reusable:
    m, n, low, band = min(reusable, key=lambda t: (t[1], t[0], t[2], t[3]))
  else:
    m, n = per_step, fft
    need_low, need_band = needs(n)
    low = min(n // 2 + 1, 2 * need_low if need_low <= 8
              else _ladder(_LOW_HEADROOM * need_low, minimum=8))
    band = min(n // 2 + 1, _ladder(2 * need_band, minimum=16))
  _USED_SIZES.add((m, n, low, band))
  return m, n, low, _block(n, low), max(low, band)


def make_plan(composition: Composition, delta, eps_error=0.01, delta_error=1e-3) -> Plan:
  """Accuracy plan for ``composition`` (concrete; batched leaves = a sweep to serve).

  The grid step makes the certified bracket upper - lower about 2 * ``eps_error`` at the smallest
  ``delta``; the window holds all but a 1e-2 * delta_error * delta fraction of the composed mass.
  """
  with jax.enable_x64(True):
    delta = float(np.min(np.asarray(delta, dtype=np.float64)))
    if not 0.0 < delta < 1.0:
      raise ValueError(f"delta must be in (0, 1); got {delta!r}")
    if not 0.0 < eps_error <= 1.0:
      raise ValueError(f"eps_error must be in (0, 1]; got {eps_error!r}")
    if not 0.0 < delta_error < 1.0:
      raise ValueError(f"delta_error must be in (0, 1); got {delta_error!r}")
    composition.check()
    total = float(sum(np.max(np.asarray(c, dtype=np.float64)) for c in composition.counts))
    eta = delta_error * delta
    log_tail = math.log(1e-3 * eta / max(total, 1.0))
    log_window_tail = math.log(1e-2 * eta)
    # Bracket ~ T beta(h) + h (sqrt(T log(1/eta)/2) + 1 + a few guard moves), beta(h) ~ h^2/8.
    target = 1.8 * eps_error  # the rest of 2 eps_error: the delta slack of the lower bound
    slope = math.sqrt(0.5 * total * math.log(1.0 / eta)) + 5.0
    curvature = total / 8.0
    h = 2.0 * target / (slope + math.sqrt(slope * slope + 4.0 * curvature * target))
    with np.errstate(all="ignore"):  # numpy evaluates both sides of the models' selects
      ranges, windows, variances = _plan_widths(composition, np.float64(log_tail),
                                                np.float64(log_window_tail))
    # The split adds ~h^2/6 of variance per step; keep that below 1e-4 of the loss variance so the
    # estimate stays accurate when a step's loss is narrower than the grid (small q, large sigma).
    # (At most 64x finer: a degenerate loss, e.g. a point mass, is not refined without end.)
    h = max(min(h, math.sqrt(6e-4 * float(np.min(variances)))), h / 64.0)
    per_step = _ladder(math.ceil(float(np.max(ranges)) / h) + 3)
    fft = _ladder(max(per_step, math.ceil(1.03 * float(np.max(windows)) / h) + 16))
    if fft * h > _MAX_SPAN:
      raise ValueError(f"the composed privacy loss spans {fft * h:.0f} units: epsilon is far "
                       "beyond what this accountant serves (reduce steps or raise the noise)")
    if fft > 2**26:
      raise ValueError(f"the plan needs an FFT of {fft} points; raise eps_error (now {eps_error})")
    variance = float(np.min(variances))
    per_step, fft, low, block, band = _static_sizes(
        per_step, fft, math.sqrt(variance) / h, math.sqrt(total * variance) / h, log_window_tail)
    return Plan(*(np.asarray(v, np.float64) for v in (h, log_tail, log_window_tail, delta_error)),
                per_step, fft, low, block, band)


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
  Gaussian-like only takes the slower full-spectrum branch, see _high_band)."""
  level = -log_window_tail + 0.5 * math.log(fft) + 5.0
  k = 4.0 * fft * math.sqrt(0.5 * level) / (math.pi * max(sd_bins, 1e-9)) + 16
  return min(fft // 2 + 1, _ladder(k, minimum=16))


def widen(plan: Plan) -> Plan | None:
  """The same plan with a twice larger FFT window (after a WINDOW_TOO_SMALL status); None when
  that window would span more loss than float64 serves (``_MAX_SPAN``)."""
  fft = _ladder(2 * plan.fft_size)
  if fft * float(plan.grid_step) > _MAX_SPAN:
    return None
  low = min(2 * plan.low_frequencies, fft // 2 + 1)
  band = min(2 * plan.band, fft // 2 + 1)
  _USED_SIZES.add((plan.per_step_size, fft, low, band))
  return dataclasses.replace(plan, fft_size=fft, low_frequencies=low, block=_block(fft, low),
                             band=band)
