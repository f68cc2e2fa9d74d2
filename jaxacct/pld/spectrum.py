"""Composition of discretised steps by FFT, with certified round-off (Gopi, Lee and Wutschitz
2021, Sec. 5, made certified).

Spectra (rfft) are raised to the counts and multiplied. The low band, where F ~ 1 and an FFT's
round-off would be amplified count-fold by the power, is computed directly
(``low_log_spectrum``); the other coefficients carry a per-coefficient round-off bound. The
composed pmf is read from a window of the circular result placed by a Chernoff bound on the
discrete steps' exact moment generating functions. The mass that can leave the window, the
per-step truncated tails, FFT round-off and the round-off of the split are all bounded and kept
with the composed pmf (the query absorbs them into its bounds). A PLD kept as its band takes no
FFT of the plan's size: its band's coefficients come from block moments (``band_transform``)
and the bound above it from the step's own grid (``_largest_above_band``), where their
allowances keep its bounds as tight as the FFT's (``_band_only_or_whole``).

Counts must be integers: ``integer_count`` refuses to be differentiated (d/dT of a grid
composition does not exist; the CGF accountants take real counts).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from jaxacct import results
from jaxacct._numerics import F64_EPS, array_namespace, sin_cos_pi_fraction
from jaxacct.composition import map_entries
from jaxacct.pld.discretise import TILTS, discretise, step_cgf, window_edges

# Constant in the FFT round-off bound ||err||_2 <= c eps (ops) ||f||_2.
_FFT_ULPS = 8.0


@jax.custom_jvp
def integer_count(count):
  """A step count as an integer-valued float64 (rounded). The PLD accountant composes whole
  steps: differentiating it with respect to a count raises (a silent zero would be wrong)."""
  return jnp.round(jnp.asarray(count, jnp.float64))


def _integer_count_jvp(primals, tangents):
  if not isinstance(tangents[0], SymbolicZero):
    raise ValueError("the PLD accountant composes whole steps: epsilon and delta are not "
                     "differentiable with respect to a step count (differentiate with respect to "
                     "the models' parameters, or use accountant='spa', 'edgeworth' or 'rdp', "
                     "which take real counts)")
  out = integer_count(primals[0])
  return out, jnp.zeros_like(out)


integer_count.defjvp(_integer_count_jvp, symbolic_zeros=True)


_TAYLOR_TERMS = 9  # block moments 0..8: the in-block expansion of e^{-i theta r} errs < 1e-17


def low_log_spectrum(pmf, n, k0, block):
  """log F'_k for k < k0, where F_k = w^(c k) F'_k (w = e^{-2 pi i/n}, c the rounded mean index).

  An FFT computes F_k to an absolute error ~ eps; composing T steps raises F_k to the power T, and
  where F_k is close to 1 (the low frequencies, which carry the composed distribution) that error
  becomes a relative error ~T eps / (1 - |F_k|) of the composed spectrum: enough to move delta by
  1e-5 relative at T = 1e5. Here A_k = S - F'_k is accumulated from terms that are each accurate
  relative to their own size (1 - e^{-ix} as 2 sin^2(x/2) + 2i sin(x/2) cos(x/2), x/2 reduced
  exactly: ``sin_cos_pi_fraction``), so log F'_k = log S + log1p(-A_k/S) has a relative error
  ~eps and T log F'_k stays accurate. Positions are grouped in blocks of ``block`` points,
  inside which e^{-i theta r} is expanded to order 8 (theta block <= 0.05), so the cost is
  (M / block) * k0 rather than M * k0, done in chunks of frequencies so that memory stays within
  a few arrays of the FFT's length.
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
  frequencies = jnp.arange(k0, dtype=jnp.float64)                    # [k0] k
  # Real and imaginary parts of (-i)^p for p = 1..8 (the rows of one matrix product).
  signs = np.stack([np.where(p[1:] % 2 == 0, (-1.0) ** (p[1:] // 2), 0.0),
                    np.where(p[1:] % 2 == 1, -((-1.0) ** (p[1:] // 2)), 0.0)])   # [2, P-1]

  def log_spectrum(k):  # [c] frequencies -> (log F'_k, |z_k|)
    freqs = (2.0 * math.pi / n) * k                              # angular frequencies
    # x = 2 pi k offset / n, from the exact integer k offset (x/2 reduced exactly)
    half_sin, half_cos = sin_cos_pi_fraction(k[:, None] * offsets[None, :], n)  # [c, blocks]
    one_minus_re = 2.0 * half_sin * half_sin                     # 1 - e^{-ix}, each part
    one_minus_im = 2.0 * half_sin * half_cos                     # accurate to its own size
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
    log_f, deviation = log_spectrum(frequencies)
  else:
    chunks = -(-k0 // chunk)
    in_chunks = jnp.concatenate([frequencies, jnp.zeros(chunks * chunk - k0)])
    log_f, deviation = jax.lax.map(log_spectrum, in_chunks.reshape(chunks, chunk))
    log_f, deviation = log_f.reshape(-1)[:k0], deviation.reshape(-1)[:k0]
  return log_f, centre.astype(jnp.int64), deviation


_TINY = 1e-150  # spectrum values below this count as 0 (their powers are below 1e-150)
# A low-band coefficient is taken from the direct sums only where every step has |z| <= this
# (|F'_k| >= S/2, so 1 - z keeps its relative accuracy); elsewhere the FFT value is used.
_LOW_BAND_MAX_Z = 0.5


def _log_spectrum(transform, fft_abs):
  """Per coefficient of one step's spectrum: log F (0 where |F| < _TINY), whether |F| >= _TINY,
  and the relative round-off of F^count per unit of count: the FFT's absolute error (~eps
  log2(n) ||pmf||_2) relative to |F_k|, plus the power's own rounding.

  A composed spectrum is exp(sum_j count_j log F_j), 0 where a counted step has |F| < _TINY
  (its power is below 1e-150; keeping log finite there keeps gradients finite: the objection to
  exp(k log F) is NaN gradients where F underflows). Its round-off is bounded by the sum of
  count_j times the rate (``spectrum_error``); the low band, where that error would be
  amplified, is replaced by ``low_log_spectrum``.
  """
  magnitude = jnp.abs(transform)
  keep = magnitude > _TINY
  log_f = jnp.where(keep, jnp.log(jnp.where(keep, transform, 1.0)), 0.0)
  floor = jnp.maximum(magnitude, _TINY)
  # exp(c log F) rounds c log|F| and c arg F (|arg| <= pi) in the exponent, and the sum over
  # steps adds its own rounding: 4 eps (1 + |log|F|| + pi) per unit of count covers all three.
  rate = fft_abs / floor + 4.0 * F64_EPS * (1.0 + jnp.abs(jnp.log(floor)) + math.pi)
  return log_f, keep, jax.lax.stop_gradient(rate)


def _power_sums(log_sum, zero):
  """exp of a composed log spectrum, 0 where a counted step's coefficient was below _TINY."""
  return jnp.where(zero, 0.0 + 0j, jnp.exp(log_sum))


def _rotation(phase, k, n):
  """w^(phase k) = exp(-2 pi i ((phase k) mod n) / n), with the product reduced exactly."""
  turns = jnp.mod(jnp.mod(phase, n) * k, n).astype(jnp.float64) / n
  return jnp.exp(-2j * math.pi * turns)


def _whole_transform_terms(pmf, plan, logs):
  """The step's transform on the whole grid (an FFT of the plan's size): the logs of its first
  ``logs`` coefficients with their round-off rates, the coefficients above them as they are
  (``high``) and, where the plan has a band, ``largest``: the exact step's largest |F_k| above
  it (+ the FFT's error)."""
  n, k1 = plan.fft_size, plan.band
  transform = jnp.fft.rfft(pmf, n=n)
  fft_abs = _whole_fft_error(pmf, n)
  log_f, keep, rate = _log_spectrum(transform[:logs], fft_abs)
  terms = dict(log_f=log_f, keep=keep, rate=rate, fft_abs=fft_abs)
  if logs < n // 2 + 1:
    terms["high"] = transform[logs:]
  if k1 < n // 2 + 1:
    terms["largest"] = _largest_in(transform[k1:], fft_abs)
  return terms


def _whole_fft_error(pmf, n):
  """The per-coefficient round-off allowance of the step's FFT of size n (~eps log2(n)
  ||pmf||_2)."""
  return jax.lax.stop_gradient(_FFT_ULPS * F64_EPS * math.log2(n) * jnp.sqrt(jnp.sum(pmf ** 2)))


def _largest_in(high, fft_abs):
  """The exact step's largest |F_k| over the computed coefficients ``high``, bounded (+ their
  round-off allowance)."""
  return jnp.max(jnp.abs(jax.lax.stop_gradient(high))) + fft_abs


# ``band_transform``: Taylor terms of e^{-i theta (a - c)} within a block, and the largest
# theta (a - c) they serve (the first dropped term is below 1e-19 of the mass); blocks of
# 16 to 1,024 points (with fewer, its 14 small FFTs would cost more than the one it replaces).
_BAND_TAYLOR_TERMS = 14
_BAND_BLOCK_ANGLE = 0.25
_BAND_BLOCKS = (16, 1024)


def band_block(n: int, band: int) -> int:
  """Block length of ``band_transform``: the largest power of two dividing ``n`` (at most
  1,024) whose half, times the band's highest frequency 2 pi (band - 1) / n, is at most
  ``_BAND_BLOCK_ANGLE``."""
  top = 2.0 * math.pi * (band - 1) / n
  block = 1
  while (n % (2 * block) == 0 and 2 * block <= _BAND_BLOCKS[1]
         and top * (2 * block - 1) / 2.0 <= _BAND_BLOCK_ANGLE):
    block *= 2
  return block


@functools.lru_cache(maxsize=None)
def _band_moment_table(block: int) -> np.ndarray:
  """[block, terms] (a - c)^r / r! for a < block, c = (block - 1) / 2, each correctly rounded
  (Python's division of whole numbers)."""
  return np.array([[(2 * a - (block - 1)) ** r / (2 ** r * math.factorial(r))
                    for r in range(_BAND_TAYLOR_TERMS)] for a in range(block)])


def band_transform(pmf, n: int, band: int):
  """F_k = sum_j pmf_j e^{-2 pi i j k / n} for k < ``band`` without an FFT of size n, and a
  bound on each value's absolute error.

  With j = b B + a (blocks of B = ``band_block`` points, centre c = (B - 1) / 2) and
  theta_k = 2 pi k / n, F_k = e^{-i theta_k c} sum_r (-i theta_k)^r S_r(k), where
  S_r(k) = sum_b m_{b,r} e^{-2 pi i b k / (n/B)} is the FFT of size n / B of the block moments
  m_{b,r} = sum_a pmf_{bB+a} (a - c)^r / r!. The bound adds the Taylor remainder
  (theta c)^R / R! of the mass; the round-off of the moments ((B + 1) eps of each term's
  |pmf (a - c)^r / r!|, carried through the exact transform) and of the combination (theta^r,
  Horner and the phase: 5 R + 9 eps), both within mass e^{theta c}; and each small FFT's
  worst-case error c eps log2(n/B) sqrt(n/B) ||m_r||_2, times theta^r."""
  m = pmf.shape[-1]
  block = band_block(n, band)
  size, blocks = n // block, -(-m // block)
  top, centre = 2.0 * math.pi * (band - 1) / n, 0.5 * (block - 1)
  padded = jnp.concatenate([pmf, jnp.zeros(blocks * block - m)]).reshape(blocks, block)
  moments = padded @ _band_moment_table(block)                        # [blocks, R]
  sums = jnp.fft.rfft(moments.T, n=size)[:, :band]                    # [R, band]
  k = jnp.arange(band, dtype=jnp.float64)
  step = -1j * ((2.0 * math.pi / n) * k)                              # -i theta_k
  value = sums[-1]
  for r in range(_BAND_TAYLOR_TERMS - 2, -1, -1):
    value = value * step + sums[r]
  sin, cos = sin_cos_pi_fraction(k * (block - 1), n)                  # theta_k c = pi k (B-1)/n
  value = jax.lax.complex(cos, -sin) * value
  held = jax.lax.stop_gradient((pmf, moments))
  mass = jnp.sum(jnp.abs(held[0]))
  terms = _BAND_TAYLOR_TERMS
  growth = math.exp(top * centre)  # (sum_r (theta c)^r / r!)
  remainder = (top * centre) ** terms / math.factorial(terms)
  norms = jnp.sqrt(jnp.sum(held[1] ** 2, axis=0)) * top ** np.arange(terms)
  transforms = _worst_fft_error(size) * jnp.sum(norms)
  error = (1.01 * (remainder + (block + 5 * terms + 10) * F64_EPS * growth) * mass
           + 1.01 * transforms)
  return value, error


def _worst_fft_error(size):
  """The worst-case error of any one coefficient of an FFT of ``size`` points, per unit of its
  input's 2-norm: c eps log2(size) sqrt(size) (the whole transform's error in 2-norm)."""
  return _FFT_ULPS * F64_EPS * math.log2(max(size, 2)) * math.sqrt(size)


def _largest_above_band(pmf, plan, centre):
  """A bound on the exact step's largest |F_k| for band <= k <= n/2 from its transform at the
  step grid's own length m (the frequencies 2 pi k'/m): every theta_k lies within pi/m of one of
  them at or above band m / n, and |F| changes by at most |theta - theta'| sum_j |j - c| pmf_j
  between them; plus that transform's worst-case error c eps log2(m) sqrt(m) ||pmf||_2."""
  pmf = jax.lax.stop_gradient(pmf)
  m, n, k1 = pmf.shape[-1], plan.fft_size, plan.band
  samples = jnp.abs(jnp.fft.rfft(pmf)[(k1 * m) // n:])
  spread = jnp.sum(jnp.abs((jnp.arange(m, dtype=jnp.float64) - centre.astype(jnp.float64))
                           * pmf))
  fft_error = _worst_fft_error(m) * jnp.sqrt(jnp.sum(pmf ** 2))
  return (jnp.max(samples) * (1.0 + 4.0 * F64_EPS) + fft_error
          + (math.pi / m) * spread * (1.0 + (m + 4) * F64_EPS))


def _band_transform_terms(pmf, plan, centre):
  """``_whole_transform_terms`` for a PLD kept as its band, without the transform on the whole
  grid: the band's coefficients from ``band_transform`` and ``largest`` from
  ``_largest_above_band``. On the whole grid where the band's blocks would be too short, or
  where the step's grid is over half the plan's (its own FFT, which the bound above the band
  takes, then saves little, and is wasted where ``_band_only_or_whole`` takes the whole grid's
  after all)."""
  if (band_block(plan.fft_size, plan.band) < _BAND_BLOCKS[0]
      or 2 * plan.per_step_size > plan.fft_size):
    return _whole_transform_terms(pmf, plan, plan.band)
  value, error = band_transform(pmf, plan.fft_size, plan.band)
  error = jax.lax.stop_gradient(error)
  log_f, keep, rate = _log_spectrum(value, error)
  # (``whole_rate``: the rates the whole grid's FFT allowance would give these values, which
  # ``band_fields_from_terms`` compares against; ``pmf``: for the whole grid's FFT there)
  whole_rate = _log_spectrum(value, _whole_fft_error(pmf, plan.fft_size))[2]
  return dict(log_f=log_f, keep=keep, rate=rate, fft_abs=error, whole_rate=whole_rate,
              largest=_largest_above_band(pmf, plan, centre), pmf=jax.lax.stop_gradient(pmf))


def entry_terms(mech, add, plan, logs=None, band_only=False):
  """What one entry contributes, independent of its count: its discretised step's log spectrum
  (with its round-off rates) on the first ``logs`` coefficients (default: the plan's band), the
  transform above them as it is (``high``: its logs are taken only where a composition powers
  it, see ``_high_band``), the low-band log spectrum, grid position and bookkeeping. With
  ``band_only`` (a PLD kept as its band, ``band_fields_from_terms``) the band's logs and a bound
  above it only, without an FFT of the plan's size (``_band_transform_terms``)."""
  n, k0 = plan.fft_size, plan.low_frequencies
  logs = plan.band if logs is None else logs
  h = jax.lax.stop_gradient(plan.grid_step)
  step = discretise(mech, add, plan)
  step_log, centre, deviation = low_log_spectrum(step.pmf, n, k0, plan.block)
  spectral = (_band_transform_terms(step.pmf, plan, centre) if band_only
              else _whole_transform_terms(step.pmf, plan, logs))
  return dict(**spectral, low_log=step_log, centre=centre, deviation=deviation,
              start=step.start, cgf=step_cgf(step, h), log_finite=step.log_finite,
              tail=step.tail, moved=step.moved, bias=step.bias,
              max_loss=jnp.asarray(mech.max_loss(add), jnp.float64))


def _high_log_spectrum(terms, plan):
  """``_log_spectrum`` of the entries' coefficients above the band ([entries, n/2 + 1 - band]),
  from the logs ``entry_terms`` kept and the transform above them."""
  k1 = plan.band
  logs = terms["log_f"].shape[-1]
  parts = [(terms["log_f"][:, k1:], terms["keep"][:, k1:], terms["rate"][:, k1:])]
  if "high" in terms:
    parts.append(jax.vmap(_log_spectrum)(terms["high"][:, max(k1 - logs, 0):],
                                         terms["fft_abs"]))
  return [jnp.concatenate(p, axis=-1) for p in zip(*parts)]


def _weighted(counts, x):
  """sum_j counts_j x_j over the leading (entry) axis: a real product (complex x: one for each
  part), which stays one matrix product when batched over count vectors."""
  if jnp.iscomplexobj(x):
    return jax.lax.complex(_weighted(counts, jnp.real(x)), _weighted(counts, jnp.imag(x)))
  return jnp.tensordot(counts.astype(x.dtype), x, axes=1)


def _flagged(counts, x):
  """Whether any entry with a positive count has ``x`` set (leading axis: entries): a product
  of 0/1 values (exact), one matrix product when batched over count vectors (a batched
  any-reduction over the entries is ~5x slower on CPU)."""
  return _weighted((counts > 0).astype(jnp.float64), x.astype(jnp.float64)) > 0.0


def _counted_sum(counts, x):
  """sum_j counts_j x_j over the entries with a positive count only (an uncounted entry adds
  nothing, also where its x is infinite): the finite values' product, and where a counted
  entry's x is not finite the sum's value (+-inf, nan for both signs or a nan)."""
  finite = jnp.isfinite(x)
  total = _weighted(counts, jnp.where(finite, x, 0.0))
  up, down = _flagged(counts, x == jnp.inf), _flagged(counts, x == -jnp.inf)
  undefined = _flagged(counts, jnp.isnan(x)) | (up & down)
  return jnp.where(undefined, jnp.nan, jnp.where(up, jnp.inf, jnp.where(down, -jnp.inf, total)))


def _accumulate(terms, counts, plan):
  """Running sums over the entries of one direction: ``terms`` are the entries' ``entry_terms``
  stacked (leading axis: entries), ``counts`` their counts [entries]. Count-weighted sums are
  products with the counts (one matrix product for a batch of count vectors); the band's
  spectrum is their exponential. A count of 0 adds nothing, also at tilts whose MGF is +inf on
  a coarse grid, and flags nothing."""
  n, k0, k1 = plan.fft_size, plan.low_frequencies, plan.band
  counts = integer_count(counts)
  whole = counts.astype(jnp.int64)
  weighted = lambda x: _weighted(counts, x)
  flagged = lambda x: _flagged(counts, x)
  total = jnp.sum(counts)
  acc = dict(**_spectral_sums(terms, counts, k1),
             low_log=weighted(terms["low_log"]),
             low_ok=~flagged(terms["deviation"] > _LOW_BAND_MAX_Z),
             phase=jnp.tensordot(whole, terms["centre"], axes=1),
             base=jnp.tensordot(whole, terms["start"], axes=1),
             mass_error=total * _FFT_ULPS * F64_EPS, total_count=total)
  # In the low band, the direct sums' relative error times the count.
  theta_block = (2.0 * math.pi * (plan.block - 1) / n) * jnp.arange(k0)  # largest theta r
  acc["low_error"] = jax.lax.stop_gradient(
      256.0 * F64_EPS * weighted(terms["deviation"])
      + total * theta_block ** _TAYLOR_TERMS / 362880.0)
  if k1 == n // 2 + 1:
    acc["high_log"] = jnp.zeros(())
  acc["cgf"] = _counted_sum(counts, terms["cgf"])
  for key in ("log_finite", "tail", "moved", "bias"):
    acc[key] = weighted(terms[key])
  acc["loss_top"] = _loss_top(counts, terms["max_loss"])
  return acc, counts


def _spectral_sums(terms, counts, k1):
  """The sums over the entries (rounded ``counts``) that their transforms give: the band's
  composed spectrum, its relative round-off and (where the plan has a band) ``high_log``, the
  log of a bound on the composed |F_k| above it."""
  sums = dict(spectrum=_power_sums(_weighted(counts, terms["log_f"][:, :k1]),
                                   _flagged(counts, ~terms["keep"][:, :k1])),
              spectrum_error=_weighted(counts, terms["rate"][:, :k1]))
  if "largest" in terms:
    sums["high_log"] = _weighted(counts, jnp.log(jnp.maximum(terms["largest"], _TINY)))
  return sums


def _loss_top(counts, max_loss):
  """sum_j count_j max_loss_j rounded up: no finite composed loss exceeds it (+inf where a
  counted step's loss is unbounded; a step of count 0 constrains nothing)."""
  bounded = jnp.isfinite(max_loss)
  safe = jnp.where(bounded, max_loss, 0.0)
  top = _weighted(counts, safe)
  # round-off of the products and the sum: (entries + 1) half-ulps of sum_j count_j |max_j|
  slack = (counts.shape[0] + 2) * F64_EPS * _weighted(counts, jnp.abs(safe))
  unbounded = _flagged(counts, ~bounded)
  return jnp.where(unbounded, jnp.inf, top + jax.lax.stop_gradient(slack))


def entry_terms_by_direction(mechanisms, flags, plan, logs=None, band_only=False):
  """``entry_terms`` of the entries, stacked (``composition.map_entries``: one trace per kind of
  model, ~1.2 s less to compile for each further entry of a kind at T = 10^3), for each
  direction flag (leading axis: [directions, entries, ...]): what a batch of compositions that
  share these models needs to compute only once (with ``logs`` = n/2 + 1, also the logs above
  the band that its settings of few steps power)."""
  one = lambda add: map_entries(lambda mech: entry_terms(mech, add, plan, logs, band_only),
                                mechanisms)
  return jax.vmap(one)(jnp.asarray(flags))


def high_band_negligible(high_log, plan):
  """Whether the composed spectrum above the band may be dropped: its contribution to the summed
  pmf error, sqrt(2 (n/2 + 1 - band)) max|F_k|, is below the window's tail level."""
  n_high = plan.fft_size // 2 + 1 - plan.band
  return high_log + 0.5 * math.log(2.0 * max(n_high, 1)) <= plan.log_window_tail


def _high_band(acc, terms, counts, plan, previous=None):
  """Completes ``acc`` (leading direction axis) with the spectrum above the band.

  At large counts the composed spectrum above a small band is below any float64 concern: then
  the band's powers are all that is computed (the dropped part is bounded in ``materialise``);
  otherwise every coefficient is powered. One branch runs (a select under an outer ``vmap``).
  ``terms`` are the stacked entries of each direction, ``counts`` their (rounded) counts;
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
    def one(terms, counts):
      log_f, keep, rate = _high_log_spectrum(terms, plan)
      return _power_sums(_weighted(counts, log_f), _flagged(counts, ~keep)), _weighted(counts,
                                                                                      rate)
    spectrum, error = jax.vmap(one)(terms, counts)
    if previous is not None:
      spectrum = spectrum * previous["spectrum"][..., k1:]
      error = error + previous["spectrum_error"][..., k1:]
    return spectrum, error

  negligible = jnp.all(high_band_negligible(acc["high_log"], plan))
  spectrum, error = jax.lax.cond(negligible, dropped, computed)
  acc["spectrum"] = jnp.concatenate([acc["spectrum"], spectrum], axis=-1)
  acc["spectrum_error"] = jnp.concatenate([acc["spectrum_error"], error], axis=-1)
  return acc


def _window(acc, plan):
  """Where the composed pmf is read (grid index of its first point), bounds on the mass the
  window leaves above and below it (Chernoff on the composed CGF), and its status."""
  n = plan.fft_size
  h = jax.lax.stop_gradient(plan.grid_step)
  tilts = jnp.asarray(TILTS)
  cgf_pos, cgf_neg = acc["cgf"][0], acc["cgf"][1]
  bottom_needed, top_needed = window_edges(acc["cgf"], plan.log_window_tail)
  needed = jnp.ceil((top_needed - bottom_needed) / h).astype(jnp.int64) + 1
  fits = needed <= n
  start = jnp.where(fits, jnp.floor(bottom_needed / h).astype(jnp.int64) - (n - needed) // 2,
                    jnp.ceil(top_needed / h).astype(jnp.int64) - n + 1)
  top = (start + n).astype(jnp.float64) * h
  bottom = (start - 1).astype(jnp.float64) * h
  above = jnp.exp(jnp.minimum(0.0, jnp.min(cgf_pos - tilts * top)))
  below = jnp.exp(jnp.minimum(0.0, jnp.min(cgf_neg + tilts * bottom)))
  status = jnp.where(fits, results.OK, results.WINDOW_TOO_SMALL).astype(jnp.int32)
  return dict(start=start, window_above=above, window_below=below, status=status)


def _composed_spectrum(acc, plan):
  """The composed spectrum with its low band from the direct sums (where they hold), and each
  coefficient's relative round-off bound."""
  k0, n = plan.low_frequencies, plan.fft_size
  low = jnp.exp(acc["low_log"]) * _rotation(acc["phase"], jnp.arange(k0), n)
  ok = acc["low_ok"]
  spectrum = acc["spectrum"].at[:k0].set(jnp.where(ok, low, acc["spectrum"][:k0]))
  relative_error = acc["spectrum_error"].at[:k0].set(
      jnp.where(ok, acc["low_error"], acc["spectrum_error"][:k0]))
  return spectrum, relative_error


def _dropped_bound(high_log, plan):
  """The L1 bound of the pmf's part carried by the spectrum above the band, were it dropped:
  exp(high_log) sqrt(2 n_high) (Parseval over the n_high coefficients and their conjugates)."""
  n_high = max(plan.fft_size // 2 + 1 - plan.band, 1)
  return jnp.exp(high_log + 0.5 * math.log(2.0 * n_high))


def _dropped_error(acc, plan):
  """The L1 bound of the pmf's part carried by a spectrum dropped above the band (0 if kept)."""
  return jnp.where(high_band_negligible(acc["high_log"], plan),
                   _dropped_bound(acc["high_log"], plan), 0.0)


def _circular_shift(acc, window, n):
  """Where the window's first cell lies in the inverse transform's circular grid."""
  return jnp.mod(window["start"] - acc["base"], n)


def materialise(acc, plan):
  """Composed pmf on its window and the certificates for what the window leaves out."""
  n = plan.fft_size
  window = _window(acc, plan)
  spectrum, relative_error = _composed_spectrum(acc, plan)
  circular = jnp.fft.irfft(spectrum, n=n)
  # p_j = circular_{(j + shift) mod n}, gathered (a roll by a traced shift first copies the grid
  # twice over; see benchmarks/README.md, "Where a warm answer's run time goes"). The indices
  # are in range and distinct: no clamping, and the gradient a scatter without collisions.
  shift = _circular_shift(acc, window, n)
  pmf = circular.at[jnp.mod(jnp.arange(n) + shift, n)].get(mode="promise_in_bounds",
                                                           unique_indices=True)
  # Round-off: sum_j |err_j| <= sqrt(n) ||err||_2 = ||spectrum error||_2 (Parseval, both halves),
  # plus the inverse transform's own error c eps log2(n) sqrt(n) ||f||_2.
  coefficient_error = jnp.abs(spectrum) * relative_error
  fft_error = (math.sqrt(2.0) * jnp.sqrt(jnp.sum(coefficient_error ** 2))
               + _dropped_error(acc, plan)
               + _FFT_ULPS * F64_EPS * (math.log2(n) + 8.0) * math.sqrt(n)
               * jnp.sqrt(jnp.sum(pmf * pmf)))
  return dict(pmf=pmf, fft_error=jax.lax.stop_gradient(fft_error), **window)


def band_materialise(acc, plan):
  """``materialise`` without the inverse transform: the window's pmf as p_j = Re sum_{k < band}
  band_k e^{2 pi i j k / n}, the spectrum above the band dropped (its bound always counted: a
  band too narrow gives loose bounds, never wrong ones), so that a query evaluates delta in
  O(band) (``query._SpectralSums``) instead of O(n).

  ``fft_error`` bounds the spectrum's round-off and the dropped part as ``materialise`` does,
  and instead of the inverse transform's error, that of the queries' sums: each sum over the
  window of p_j g_j with 0 <= g_j <= 1 is sum_k band_k G_k with |G_k| <= U_k
  (``window_sum_bound``), evaluated to (band + 32) eps sum_k |band_k| U_k."""
  n, k1 = plan.fft_size, plan.band
  h = jax.lax.stop_gradient(plan.grid_step)
  window = _window(acc, plan)
  spectrum, relative_error = _composed_spectrum(acc, plan)
  spectrum, relative_error = spectrum[:k1], relative_error[:k1]
  k = jnp.arange(k1)
  shift = _circular_shift(acc, window, n)  # p_j = circular_{j + shift}
  band = band_weights(k, n) * spectrum * jnp.conj(_rotation(shift, k, n))
  sum_bound = jnp.sum(jnp.abs(band) * window_sum_bound(k, n, h))
  dropped = _dropped_bound(acc["high_log"], plan) if n // 2 + 1 > k1 else 0.0
  fft_error = (_coefficient_error(spectrum, relative_error) + dropped
               + _band_sums_round_off(k1, sum_bound))
  return dict(pmf=None, band=band, fft_error=jax.lax.stop_gradient(fft_error), **window)


def _coefficient_error(spectrum, relative_error):
  """The L1 bound of the pmf's error that the band's coefficients' round-off carries (the
  band's spectrum and relative errors): sqrt(2) ||spectrum error||_2 (Parseval, both halves)."""
  return math.sqrt(2.0) * jnp.sqrt(jnp.sum((jnp.abs(spectrum) * relative_error) ** 2))


def band_weights(k, n):
  """Each band coefficient's weight in p_j = Re sum_k band_k z^(jk): 2/n, its conjugate pair
  folded in; 1/n at k = 0 and Nyquist (their own pair). Host or JAX arrays."""
  xp = array_namespace(k)
  return xp.where((k == 0) | (2 * k == n), 1.0, 2.0) / n


def _band_sums_round_off(band, sum_bound):
  """The band sums' round-off allowance: (band + 32) eps sum_k |band_k| U_k."""
  return (band + 32) * F64_EPS * sum_bound


def window_sum_bound(k, n, h):
  """U_k >= |G_k|, G_k = sum_j g_j e^{2 pi i j k / n} for the queries' cell shares g: a count
  of whole cells, a weighted geometric sum and one partial cell (2/|1 - z| and 2/|1 - z e^-h|
  bound the geometric sums for k >= 1, n and 2/(1 - e^-h) for k = 0). Host or JAX arrays."""
  xp = array_namespace(k, h)
  theta = (2.0 * math.pi / n) * k
  half = xp.sin(0.5 * theta)
  one_minus_z = xp.hypot(2.0 * half * half, xp.sin(theta))
  damped = xp.hypot(-xp.expm1(-h) + xp.exp(-h) * 2.0 * half * half,
                    xp.exp(-h) * xp.sin(theta))
  whole = xp.where(k == 0, float(n), 2.0 / xp.where(k == 0, 1.0, one_minus_z))
  return whole + 2.0 / damped + 1.0


def band_round_off(plan):
  """A host bound on the band sums' round-off allowance in ``band_materialise``'s fft_error,
  (band + 32) eps sum_k |band_k| U_k, from |band_k| <= its weight (|F_k| <= the mass, 1), at
  the plan's finest step. (~5e-13 at T = 10^4: next to delta 1e-10 it loosens the bounds.)"""
  n, k = plan.fft_size, np.arange(plan.band)
  bound = window_sum_bound(k, n, np.min(np.asarray(plan.grid_step, np.float64)))
  return _band_sums_round_off(plan.band, float(np.sum(band_weights(k, n) * bound))) * (1.0 + 1e-6)


def directions(composition):
  """Direction flags to compose: remove only for symmetric lists, else remove and add."""
  return np.array([0.0] if composition.symmetric else [0.0, 1.0])


def fields_from_terms(terms, counts, plan, previous=None):
  """The composed PLD's fields for each direction from the entries' stacked terms
  (``entry_terms_by_direction``: [directions, entries, ...]) and counts ([entries]);
  ``previous`` holds the fields of a PLD being appended to (its spectrum, low_ok and running
  sums: spectra multiply, running sums add)."""
  counts = jnp.stack([jnp.asarray(c, jnp.float64) for c in counts]) if isinstance(
      counts, (list, tuple)) else jnp.asarray(counts, jnp.float64)
  acc, rounded = jax.vmap(_accumulate, in_axes=(0, None, None))(terms, counts, plan)
  if previous is not None:
    k1 = plan.band
    for key in RUNNING_SUMS:
      if key not in ("spectrum_error", "high_log"):
        acc[key] = acc[key] + previous[key]
    acc["loss_top"] = acc["loss_top"] + jax.lax.stop_gradient(  # (the sum's own round-off)
        F64_EPS * (jnp.abs(acc["loss_top"]) + jnp.abs(previous["loss_top"])))
    acc["low_ok"] = acc["low_ok"] & previous["low_ok"]
    acc["spectrum"] = acc["spectrum"] * previous["spectrum"][:, :k1]
    acc["spectrum_error"] = acc["spectrum_error"] + previous["spectrum_error"][:, :k1]
  acc = _high_band(acc, terms, rounded, plan, previous)
  return dict(**acc, **jax.vmap(materialise, (0, None))(acc, plan))


def band_fields_from_terms(terms, counts, plan):
  """``fields_from_terms`` with the pmf kept as its band (``band_materialise``: queries in
  O(band), no inverse transform). Exact when ``high_band_negligible`` (else certified but
  loose: choose the band so). ``terms`` may be cut to the band (with their ``largest`` above
  it), or band-only (``entry_terms(band_only=True)``, with the steps' ``pmf``: see
  ``_band_only_or_whole``). Band fields cannot be appended to (their spectrum stops at the
  band)."""
  counts = jnp.asarray(counts, jnp.float64)
  acc, rounded = jax.vmap(_accumulate, in_axes=(0, None, None))(terms, counts, plan)
  if "pmf" in terms:
    acc = dict(acc, **_band_only_or_whole(acc, terms, rounded, plan))
  return dict(**acc, **jax.vmap(band_materialise, (0, None))(acc, plan))


# Band-only terms serve where the part of ``fft_error`` they set stays within this share of
# what the whole grid's FFT allowance would give.
_BAND_ONLY_ERROR_SHARE = 1e-3


def _band_only_or_whole(acc, terms, rounded, plan):
  """The band's spectral sums (``_spectral_sums``) from band-only terms (no FFT of the plan's
  size: ``acc``'s) where they are as good as the whole grid's (``_band_only_serves``); else
  from each step's FFT of the plan's size (``_whole_transform_terms``), as before. One
  runtime branch (a select, both computed, under a caller's vmap). ``rounded``: the counts
  [directions, entries]."""
  negligible, within = _band_only_serves(acc, terms, rounded, plan)
  keys = ("spectrum", "spectrum_error", "high_log")

  def whole():
    transformed = jax.vmap(jax.vmap(lambda pmf: _whole_transform_terms(pmf, plan, plan.band)))(
        terms["pmf"])
    return jax.vmap(lambda t, c: _spectral_sums(t, c, plan.band))(transformed, rounded)

  return jax.lax.cond(negligible & within, lambda: {key: acc[key] for key in keys}, whole)


def _band_only_serves(acc, terms, rounded, plan):
  """Whether band-only sums ``acc`` serve: (the spectrum above the band negligible by their
  bound, ``_largest_above_band``; the part of ``fft_error`` they set, the coefficients'
  round-off and the dropped spectrum, within ``_BAND_ONLY_ERROR_SHARE`` of the coefficients'
  round-off under the whole grid's FFT allowance). Their values' allowance
  (``band_transform``'s) is the larger: it matters where their powers are not small (a low
  band read from the transform, ``low_ok`` false)."""
  as_whole = dict(acc, spectrum_error=jax.vmap(_weighted)(rounded, terms["whole_rate"]))
  norm = jax.vmap(lambda a: _coefficient_error(
      *(part[:plan.band] for part in _composed_spectrum(a, plan))))
  dropped = jax.vmap(lambda a: _dropped_error(a, plan))(acc)
  return (jnp.all(high_band_negligible(acc["high_log"], plan)),
          jnp.all(norm(acc) + dropped <= norm(as_whole) * (1.0 + _BAND_ONLY_ERROR_SHARE)))


def compose_fields(composition, plan):
  """The composed PLD's fields for each adjacency direction (leading axis; pure, jit/vmap-able)."""
  terms = entry_terms_by_direction(composition.mechanisms, directions(composition), plan)
  return fields_from_terms(terms, composition.counts, plan)


def compose_band_fields(composition, plan):
  """``compose_fields`` with the pmf kept as its band (``band_fields_from_terms``): no inverse
  transform, queries in O(band). Certified always; as tight as ``compose_fields`` only where
  ``high_band_negligible`` holds (else the dropped spectrum's bound makes it loose)."""
  terms = entry_terms_by_direction(composition.mechanisms, directions(composition), plan,
                                   band_only=True)
  return band_fields_from_terms(terms, composition.counts, plan)


RUNNING_SUMS = ("low_log", "low_error", "phase", "spectrum_error", "high_log", "mass_error",
                "base", "cgf", "log_finite", "tail", "moved", "bias", "total_count", "loss_top")


def append_fields(previous, composition, plan):
  """The fields after further steps: ``previous`` (a composed PLD's fields: its spectrum, low_ok
  and running sums) followed by ``composition``."""
  n_dir = previous["spectrum"].shape[0]
  if directions(composition).shape[0] > n_dir:
    raise ValueError("cannot append an asymmetric mechanism to a PLD composed in one direction; "
                     "compose the whole list instead")
  terms = entry_terms_by_direction(composition.mechanisms, np.array([0.0, 1.0][:n_dir]), plan)
  return fields_from_terms(terms, composition.counts, plan, previous)
