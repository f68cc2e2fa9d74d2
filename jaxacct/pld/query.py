"""Queries of a composed PLD: certified epsilon(delta) and delta(epsilon).

Each grid mass is spread over its cell (the estimate and the bounds each with their own
placement), so delta(eps) is C^1 in eps and in every parameter; epsilon(delta) is its inverse,
found cell by cell and differentiated implicitly (``_solver.implicit_root``).

Lower bound: the connect-the-dots split is a coupling with D - L in an interval of length h and
mean in [0, beta(h)], beta ~ h^2/8. Hoeffding gives sum L >= sum D - T beta - h sqrt(T log(1/eta)/2)
except with probability eta; delta at the shifted epsilon minus eta is a lower bound.

Top of the loss: a model that bounds its loss (``max_loss``: Laplace, randomized response,
(epsilon, delta)) bounds the composed finite loss by the steps' sum, ``loss_top``; delta is then
at most P(inf) + P(finite) (1 - e^{eps - top})_+, which the upper takes where it is smaller than
the grid's. At and beyond the top it is P(inf) exactly (0 for pure DP), free of the grid's
spread, window and round-off terms; a pure-DP epsilon never exceeds the top (where the grid
serves delta at all: below its floor epsilon stays +inf with BELOW_FLOOR, see
``_epsilon_direction``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxacct import results
from jaxacct._numerics import F64_EPS
from jaxacct._solver import bisect_whole, implicit_root, newton_in_bracket
from jaxacct.results import Bounds


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


def _cell_share(w, h):
  """What one unit of mass spread over a cell [L, L + h] (uniformly in u = e^{-y}) contributes
  to delta at eps = L + w: the mean of (1 - e^{eps - y})_+. With kappa = (1 + e^{-h})/2 it is
  1 - kappa e^w for w <= 0 (the whole cell above eps), 0 for w >= h, and
  expm1(w - h)^2 e^{-w} / (2 (1 - e^{-h})) in between: C^1 in w (and so in eps)."""
  partial, _ = _partial_share(jnp.clip(w, 0.0, h), h)
  kappa = 1.0 + 0.5 * jnp.expm1(-h)
  whole = 1.0 - kappa * jnp.exp(jnp.minimum(w, 0.0))
  return jnp.where(w <= 0.0, whole, partial)


def _partial_share(w, h):
  """``_cell_share`` for 0 <= w <= h, and its slope in w."""
  spread = -2.0 * jnp.expm1(-h)
  value = jnp.expm1(w - h) ** 2 * jnp.exp(-w) / spread
  slope = jnp.exp(-w) * jnp.expm1(w - h) * (jnp.exp(w - h) + 1.0) / spread
  return value, slope


def _delta_on_grid(pmf, first_centre, h, eps):
  """sum_i pmf_i x the mean of (1 - e^{eps - y})_+ over its mass spread uniformly in e^{-y}
  over the cell [c_i - h/2, c_i + h/2] (finite part).

  Uniform in e^{-y}, not in y: (1 - e^{eps - y})_+ is convex in e^{-y}, so a spread that keeps
  the cell's mean of e^{-y} (the upper bound's and the estimate's: cells shifted by log cosh(h/2)
  ~ h^2/8) can only raise delta, by Jensen (the upper stays certified with no shift of h/2),
  and one wholly below c_i (the lower bound's) only lower it."""
  lefts = first_centre - 0.5 * h + jnp.arange(pmf.shape[0]) * h
  return jnp.sum(pmf * _cell_share(eps - lefts, h))


_TAIL_BLOCK = 512  # grid points per block of the two-level tail sums
_TRIANGLE_MAX = 2048  # longest axis whose suffix sums are products with triangular matrices
_TRIANGLE = 32  # ... each of at most this side (a larger one costs more to build than to use)


def _triangle(n, dtype):
  """The n x n 0/1 matrix U[j, i] = (j >= i): x @ U is x's suffix sums."""
  return (jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]).astype(dtype)


def _suffix_sums(x):
  """sum_{j >= i} x_j along the last axis. Up to _TRIANGLE_MAX values as products with small
  triangular 0/1 matrices (``jnp.cumsum`` compiles to a dozen kernels on CPU, and one n x n
  matrix is built anew at each call: 2 MB at n = 512): within blocks of _TRIANGLE, then over
  the blocks after each one. Beyond that (block sums of a huge grid), a reversed cumulative
  sum."""
  n = x.shape[-1]
  if n > _TRIANGLE_MAX:
    return jnp.flip(jnp.cumsum(jnp.flip(x, -1), -1), -1)
  if n <= _TRIANGLE:
    return x @ _triangle(n, x.dtype)
  blocks = -(-n // _TRIANGLE)
  padding = [(0, 0)] * (x.ndim - 1) + [(0, blocks * _TRIANGLE - n)]
  rows = jnp.pad(x, padding).reshape(x.shape[:-1] + (blocks, _TRIANGLE))
  within = rows @ _triangle(_TRIANGLE, x.dtype)                    # [..., blocks, T]
  totals = within[..., 0]
  later = _suffix_sums(jnp.concatenate([totals[..., 1:], jnp.zeros_like(totals[..., :1])], -1))
  return (within + later[..., None]).reshape(x.shape[:-1] + (-1,))[..., :n]


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

  rows: jax.Array   # [2, blocks, B] pmf and scaled, zero padded (as stacked: no transposed copy)
  after: jax.Array  # [2, blocks + 1] their sums over blocks >= J
  h: jax.Array
  n: int = dataclasses.field(metadata=dict(static=True))  # N, the unpadded length

  @staticmethod
  def of(pmf, h):
    n = pmf.shape[0]
    block = min(_TAIL_BLOCK, n)
    blocks = -(-n // block)
    rel = (jnp.arange(n) - n // 2).astype(jnp.float64) * h
    # (a product, not a stack of pmf and pmf e^{-rel}: under vmap a stack moves the batch axis,
    # and XLA copies the grid twice over to move it back)
    both = jnp.stack([jnp.ones_like(rel), jnp.exp(-rel)]) * pmf           # [2, N]
    rows = jnp.pad(both, ((0, 0), (0, blocks * block - n))).reshape(2, blocks, block)
    after = jnp.pad(_suffix_sums(jnp.sum(rows, 2)), ((0, 0), (0, 1)))
    return _TailSums(rows, after, h, n)

  def _weight(self, b):
    """kappa e^{rel_b}: d(b) = mass(b) - kappa e^{rel_b} scaled(b) (``_cell_share`` at w <= 0)."""
    rel = (b - self.n // 2).astype(jnp.float64) * self.h
    return (1.0 + 0.5 * jnp.expm1(-self.h)) * jnp.exp(rel)

  def delta_at_start(self):
    """(total mass, d(0))."""
    total, scaled = self.after[:, 0]
    return total, total - self._weight(jnp.zeros((), jnp.int64)) * scaled

  def crossing(self, target):
    """The cell where d falls to ``target`` (d is non-increasing up to round-off): the first
    boundary k with d(k) <= target (a count over block starts, then over one block's
    boundaries); the cell i = max(k - 1, 0) (up to round-off between the two counts); d at i
    and i + 1; beyond i + 1 the mass and the weighted sum c e^{rel_{i+1}} sum scaled; pmf_i."""
    _, blocks, block = self.rows.shape
    starts = jnp.arange(blocks) * block
    d_starts = self.after[0, :-1] - self._weight(starts) * self.after[1, :-1]
    j = jnp.clip(jnp.sum(d_starts > target) - 1, 0, blocks - 1)
    # Boundaries j B, ..., (j + 1) B of the row: its suffix sums plus the blocks after it.
    row = self.rows[:, j]                                                  # [2, B]
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

  def crossings(self, targets):
    """``crossing`` of each target (one per placement), in a loop (see ``_worst_direction``)."""
    return jax.lax.map(self.crossing, targets)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _SpectralSums:
  """``_TailSums`` of a pmf kept as its band, p_j = Re sum_k band_k z_k^j (z_k = e^{2 pi i k/N},
  ``spectrum.band_materialise``), each sum in O(band) by closed-form geometric sums:
  mass(b) = sum_{j >= b} p_j = Re [band_0 (N - b) + sum_{k >= 1} band_k (z^b - 1) / (1 - z)],
  weighted(b) = kappa sum_{j >= b} p_j e^{-(j - b) h}
              = kappa Re sum_k band_k (z^b - e^{-(N - b) h}) / (1 - z e^{-h}),
  d(b) = mass(b) - weighted(b), and p_{b-1} = Re sum_k band_k z^b / z. The three are one product
  of z^b with fixed coefficients (a matrix product over many boundaries). Each term is at most
  |band_k| U_k (``spectrum.window_sum_bound``); the PLD's fft_error holds the sums' round-off."""

  coef: jax.Array      # [K, 3] complex: band/(1 - z) (0 for k = 0), kappa band/(1 - z e^-h), band/z
  fixed: jax.Array     # [2]: Re sum band/(1 - z) and Re sum kappa band/(1 - z e^-h)
  total_rate: jax.Array  # Re band_0: mass per whole-window cell of the k = 0 term
  h: jax.Array
  n: int = dataclasses.field(metadata=dict(static=True))

  @staticmethod
  def of(band, h, n):
    one_minus_z, geometric, inverse_z = _root_terms(band.shape[0], n)
    kappa = 1.0 + 0.5 * jnp.expm1(-h)
    damped = kappa / (-jnp.expm1(-h) + jnp.exp(-h) * one_minus_z)
    coef = jnp.stack([band * geometric, band * damped, band * inverse_z], axis=1)
    fixed = jnp.real(jnp.sum(coef[:, :2], axis=0))
    return _SpectralSums(coef, fixed, jnp.real(band[0]), h, n)

  def _at(self, b):
    """(mass(b), weighted(b), p_{b-1}) at the boundary b (0 <= b <= N)."""
    return self.parts(b, jnp.real(_powers(b, self.coef.shape[0], self.n) @ self.coef))

  def parts(self, b, sums):
    """``_at`` from the three sums Re sum_k coef_k z^(b k) (``sums``, last axis)."""
    tail = jnp.exp(-(self.n - b).astype(jnp.float64) * self.h)
    mass = self.total_rate * (self.n - b) + sums[..., 0] - self.fixed[0]
    return mass, sums[..., 1] - tail * self.fixed[1], sums[..., 2]

  def delta(self, first_centre, eps):
    """``_delta_on_grid`` of the pmf: the cells from J up lie wholly above eps, cell J - 1 holds
    it (its share ``_partial_share``), those below add nothing."""
    left0 = first_centre - 0.5 * self.h
    j = jnp.clip(jnp.ceil((eps - left0) / self.h), 0, self.n).astype(jnp.int64)
    return self.delta_from(left0, eps, j, self._at(j))

  def delta_from(self, left0, eps, j, parts):
    """``delta`` with the boundary J and its ``_at`` given (``left0``: the first cell's left)."""
    mass, weighted, before = parts
    left_j = left0 + j.astype(jnp.float64) * self.h
    partial, _ = _partial_share(jnp.clip(eps - (left_j - self.h), 0.0, self.h), self.h)
    return (mass - jnp.exp(jnp.minimum(eps - left_j, 0.0)) * weighted
            + jnp.where(j >= 1, partial * before, 0.0))

  def delta_at_start(self):
    mass, weighted, _ = self._at(jnp.zeros((), jnp.int64))
    return mass, mass - weighted

  def crossings(self, targets):
    """``_TailSums.crossing`` of each of a few close targets (an epsilon query's placements, the
    middle one the anchor): the first boundary k with d(k) <= target (d(N) = 0) and the cell
    i = max(k - 1, 0). The anchor's by bisection over all the boundaries, one read a step; each
    other target's in a bracket near it (``_near``: two reads, then a bisection of mostly 2
    steps): ~25 reads where a bisection per target took 60. Each bracket end carries its parts,
    so the cell's values need no reads of their own."""
    first, last = jnp.zeros((), jnp.int64), jnp.full((), self.n, jnp.int64)
    whole = (first, self._at(first), last,
             self.parts(last, jnp.real(jnp.sum(self.coef, axis=0))))      # z^N = 1
    anchor = targets.shape[0] // 2
    found = self._bisect(targets[anchor], whole)
    others = jnp.concatenate([targets[:anchor], targets[anchor + 1:]])
    near = jax.vmap(lambda t: self._bisect(t, self._near(t, found, whole)))(others)
    ends = jax.tree_util.tree_map(
        lambda a, b: jnp.concatenate([a[:anchor], b[None], a[anchor:]]), near, found)
    return jax.vmap(self._cell, (0, 0, None))(targets, ends, whole[1])

  def _bisect(self, target, ends):
    """``bisect_whole`` of the bracket ``ends`` = (lo, its parts, hi, its parts) of the
    boundaries, d(lo) > target >= d(hi) (lo = 0 unchecked)."""
    return bisect_whole(self._at, lambda parts: _d(parts) > target, ends)

  def _near(self, target, found, whole):
    """A bracket of ``target``'s crossing from the anchor's (``found``), on the side where d
    there says it lies: ends ``_REACHES`` boundaries out are read in turn, and the first whose
    d confirms the crossing lies within reach bounds it; beyond them all, the side's end."""
    _, _, k, at_k = found
    below = _d(at_k) <= target                      # the target's crossing is at or before k
    pick = lambda c, a, b: jax.tree_util.tree_map(lambda x, y: jnp.where(c, x, y), a, b)
    inner, outer, settled = (k, at_k), pick(below, whole[:2], whole[2:]), False
    for reach in _REACHES:
      end = jnp.where(below, jnp.maximum(k - reach, 0), jnp.minimum(k + reach, self.n))
      point = (end, self._at(end))
      confirmed = (_d(point[1]) > target) == below
      outer = pick(~settled & confirmed, point, outer)
      inner = pick(~settled & ~confirmed, point, inner)
      settled = settled | confirmed
    return pick(below, outer, inner) + pick(below, inner, outer)

  @staticmethod
  def _cell(target, ends, at_zero):
    """``crossing``'s result from a bisected bracket (k = 0 where d(0) <= target)."""
    _, at_lo, hi, at_hi = ends
    k = jnp.where(_d(at_zero) > target, hi, 0)
    mass_right, weighted_right, p_i = at_hi
    return k, jnp.maximum(k - 1, 0), (_d(at_lo), _d(at_hi)), mass_right, weighted_right, p_i


# Reaches (in boundaries) from the anchor's crossing at which the others' are looked for: an
# epsilon query's placements cross mostly within 3 boundaries of each other, a few up to ~50.
_REACHES = (4, 64)


def _d(parts):
  """d(b) = mass(b) - weighted(b) from ``_SpectralSums._at``'s parts."""
  mass, weighted, _ = parts
  return mass - weighted


def _powers(b, count, n):
  """z_k^b = e^{2 pi i b k / n} for k < ``count`` (b's exponent reduced exactly, mod n)."""
  m = jnp.mod(jnp.mod(b, n)[..., None] * jnp.arange(count), n)
  coarse, fine = _root_tables(n)
  return jnp.asarray(coarse)[m // fine.shape[0]] * jnp.asarray(fine)[m % fine.shape[0]]


@functools.lru_cache(maxsize=16)
def _root_terms(count, n):
  """1 - z_k, 1 / (1 - z_k) (0 at k = 0) and 1 / z_k for k < ``count`` (z_k = e^{2 pi i k / n}),
  numpy constants of the static sizes (1 - z as 2 sin^2(theta / 2) - i sin theta: no
  cancellation at small k)."""
  theta = (2.0 * np.pi / n) * np.arange(count)
  one_minus_z = 2.0 * np.sin(0.5 * theta) ** 2 - 1j * np.sin(theta)
  geometric = np.concatenate([np.zeros(1, complex), 1.0 / one_minus_z[1:]])
  return one_minus_z, geometric, np.exp(-1j * theta)


@functools.lru_cache(maxsize=16)
def _root_tables(n):
  """e^{2 pi i R j / n} and e^{2 pi i l / n} (R = ceil(sqrt n)), numpy constants: a power of an
  n-th root of unity is one product of two entries, without a transcendental per term."""
  r = math.isqrt(n - 1) + 1
  fine = np.exp(2j * np.pi * np.arange(r) / n)
  coarse = np.exp(2j * np.pi * (r * np.arange(-(-n // r))) / n)
  return coarse, fine


def _grid_delta(view, h, n):
  """(first_centre, eps) -> the grid pmf's delta (``_delta_on_grid``), from the pmf or its band
  (n: the window's length)."""
  if view["pmf"] is None:
    return _SpectralSums.of(view["band"], h, n).delta
  return lambda centre, eps: _delta_on_grid(view["pmf"], centre, h, eps)


def _tail_sums(view, h, n):
  """The crossing lookups of ``_epsilon_on_grid``, from the pmf or its band."""
  if view["pmf"] is None:
    return _SpectralSums.of(view["band"], h, n)
  return _TailSums.of(view["pmf"], h)


def _solvable(target, d0):
  """The target a crossing is looked for: a positive placeholder where there is none."""
  return jnp.where(target > 0.0, target, 0.5 * d0 + 1e-300)


def _epsilon_on_grid(grid_delta, crossing, start, first_centre, h, target, side):
  """Root of delta_grid(eps) = target; ``side`` +1 (-1) returns a point where delta <= target
  (>= target), the safe end for an upper (lower) bound. ``crossing``: the sums' crossing of the
  ``_solvable`` target; ``start``: their (total mass, d(0)). Implicit gradients via
  ``implicit_root``."""
  left0 = first_centre - 0.5 * h
  total, d0 = start
  valid = target > 0.0
  tgt = _solvable(target, d0)

  def solve(_, __):
    k, i, (d_i, d_next), mass_right, weighted_right, p_i = crossing
    a = left0 + i * h
    b = a + h

    def local(x):  # delta_grid(x) - target and its slope, for x in cell i
      tilt = jnp.exp(x - b) * weighted_right
      share, slope = _partial_share(jnp.clip(x - a, 0.0, h), h)
      return mass_right - tilt + p_i * share - tgt, -tilt + p_i * slope

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
    return grid_delta(first_centre, x) - target

  eps = implicit_root(residual, solve, jnp.zeros(()))
  return jnp.where(valid, eps, jnp.inf)


def _shifts(h):
  """Where each cell's mass is spread, for the lower bound, the estimate and the upper bound:
  the cell's centre moves by -h/2 (the mass spread below the grid point: a lower bound) or by
  log cosh(h/2) (the spread that keeps the mean of e^{-y}: an upper bound by Jensen)."""
  keep_mean = jnp.log1p(2.0 * jnp.sinh(0.25 * h) ** 2)  # log cosh(h/2), ~h^2/8
  return jnp.stack([-0.5 * h, keep_mean, keep_mean])


_ESTIMATE = np.array([0.0, 1.0, 0.0])  # only the estimate is de-biased


def _lower_shift(view, plan, eta, h):
  """s such that sum L >= sum D_safe - s except with probability 2 eta (see module docstring)."""
  total = view["total_count"]
  moves = _guard_moves(view["moved"], eta)
  hoeffding = h * jnp.sqrt(0.5 * total * jnp.log(1.0 / eta))
  return total * _coupling_bias(h) + hoeffding + moves * h


def _inf_mass_upper(view):
  """P(composed loss = +inf) rounded up: log1p, the count-weighted sum over the entries and
  expm1 each round (relatively, and a sum of like-signed terms: at most (entries + 2) half-ulps;
  the count bounds the entries)."""
  slack = (8.0 + jax.lax.stop_gradient(view["total_count"])) * F64_EPS
  return -jnp.expm1(view["log_finite"]) * (1.0 + slack)


def _support_delta(view, eps):
  """An upper delta from the loss's top alone: no finite composed loss exceeds ``loss_top``, so
  delta(eps) <= P(inf) + P(finite) (1 - e^{eps - top})_+, which is P(inf) itself from the top on
  (exact there: no grid, window or round-off term; 1 where the loss is unbounded). It decreases
  in eps, and the grid's upper is replaced by it where it is smaller."""
  p = _inf_mass_upper(view)
  below_top = -jnp.expm1(jnp.minimum(eps - view["loss_top"], 0.0))
  return (p + (1.0 - p) * below_top) * (1.0 + 4.0 * F64_EPS)


def _support_epsilon(view, delta):
  """The least eps at which ``_support_delta`` is <= ``delta``: top + log((1 - d) / (1 - p))
  (d: delta less the round-off factor), raised by the logs' and sums' round-off; +inf where
  delta does not exceed P(inf) (or the loss is unbounded)."""
  p = _inf_mass_upper(view)
  d = delta / (1.0 + 4.0 * F64_EPS)
  top = view["loss_top"]
  log_kept, log_finite = jnp.log1p(-jnp.minimum(d, 1.0)), jnp.log1p(-p)
  eps = top + (log_kept - log_finite)
  eps = eps + 4.0 * F64_EPS * jax.lax.stop_gradient(
      jnp.abs(top) + jnp.abs(log_kept) + jnp.abs(log_finite))
  return jnp.where(d > p, eps, jnp.inf)


def _epsilon_direction(view, plan, delta):
  h = jax.lax.stop_gradient(plan.grid_step)
  p_inf = -jnp.expm1(view["log_finite"])
  eta = plan.delta_error * delta
  scale = view["mass_error"]
  upper_target = (delta - p_inf - view["window_above"] - view["fft_error"]) / (1.0 + scale)
  lower_target = (delta - p_inf + 2.0 * eta + view["window_below"] + view["fft_error"]
                  + view["tail"]) / (1.0 - scale)
  targets = jnp.stack([lower_target, delta - p_inf, upper_target])
  centres = view["start"].astype(jnp.float64) * h + _shifts(h) - _ESTIMATE * view["bias"]
  n = plan.fft_size
  sums, grid_delta = _tail_sums(view, h, n), _grid_delta(view, h, n)
  start = sums.delta_at_start()
  crossings = sums.crossings(_solvable(targets, start[1]))
  solve = lambda crossing, centre, target, side: _epsilon_on_grid(grid_delta, crossing, start,
                                                                  centre, h, target, side)
  lower, estimate, upper = jax.lax.map(lambda args: solve(*args), (
      crossings, centres, targets, jnp.array([-1.0, 0.0, 1.0])))
  lower = lower - _lower_shift(view, plan, eta, h)
  # The loss's top bounds epsilon too (pure DP: epsilon <= the steps' summed top). Below the
  # grid's floor the upper stays +inf with BELOW_FLOOR, the planner's signal to rerun the
  # setting on a plan of its own (the top would serve it, but often loosely).
  support = _support_epsilon(view, delta)
  served = upper_target > 0.0
  estimate = jnp.minimum(estimate, support)
  upper = jnp.where(served, jnp.minimum(upper, support), upper)
  floor = jnp.where(served, results.OK, results.BELOW_FLOOR).astype(jnp.int32)
  status = jnp.bitwise_or(view["status"].astype(jnp.int32), floor)
  clipped = Bounds(*(jnp.maximum(e, 0.0) for e in (lower, estimate, upper)), status)
  return results.zero_if(view["total_count"] == 0, clipped)  # (no steps: exactly 0, not ~h)


def _delta_direction(view, plan, eps):
  h = jax.lax.stop_gradient(plan.grid_step)
  grid_delta = _grid_delta(view, h, plan.fft_size)
  p_inf = -jnp.expm1(view["log_finite"])
  centre0 = view["start"].astype(jnp.float64) * h
  shift = _shifts(h)
  estimate = p_inf + grid_delta(centre0 + shift[1] - view["bias"], eps)
  scale = view["mass_error"]
  upper = _upper_delta(view, grid_delta(centre0 + shift[2], eps))
  eta = plan.delta_error * jnp.maximum(estimate, 1e-300)
  shifted = eps + _lower_shift(view, plan, eta, h)
  lower = (p_inf + grid_delta(centre0 + shift[0], shifted) * (1.0 - scale) - 2.0 * eta
           - view["window_below"] - view["fft_error"] - view["tail"])
  support = _support_delta(view, eps)  # (exact at and beyond the loss's top)
  estimate, upper = jnp.minimum(estimate, support), jnp.minimum(upper, support)
  clipped = Bounds(*(jnp.clip(d, 0.0, 1.0) for d in (lower, estimate, upper)), view["status"])
  return results.zero_if(view["total_count"] == 0, clipped)


def _upper_delta(view, grid_delta):
  """The certified upper delta from the grid's delta with the upper placement: the mass at
  +inf, the grid's part widened by its mass round-off, the window's tail and the FFT's error."""
  return (_inf_mass_upper(view) + grid_delta * (1.0 + view["mass_error"])
          + view["window_above"] + view["fft_error"])


def _upper_curve_direction(view, plan, eps_points):
  """``_delta_direction``'s upper at many points from one pass of suffix sums: each point is
  read at the upper placement's cell boundary at or below it (delta does not increase with eps,
  so that value bounds it from above), where the cells from b up lie wholly above it (share
  1 - kappa e^{boundary - left}) and those below add nothing; below the window, at eps itself."""
  h = jax.lax.stop_gradient(plan.grid_step)
  support = _support_delta(view, eps_points)
  if view["pmf"] is None:  # from the band each point costs O(band): read at the point itself
    grid_delta = _grid_delta(view, h, plan.fft_size)
    centre = view["start"].astype(jnp.float64) * h + _shifts(h)[2]
    grid = jax.vmap(lambda e: grid_delta(centre, e))(eps_points)
    return jnp.minimum(_upper_delta(view, jnp.maximum(grid, 0.0)), support)
  pmf = view["pmf"]
  n = pmf.shape[0]
  left0 = view["start"].astype(jnp.float64) * h + _shifts(h)[2] - 0.5 * h
  rel = (jnp.arange(n) - n // 2).astype(jnp.float64) * h
  mass = jnp.concatenate([jnp.cumsum(pmf[::-1])[::-1], jnp.zeros(1)])
  scaled = jnp.concatenate([jnp.cumsum((pmf * jnp.exp(-rel))[::-1])[::-1], jnp.zeros(1)])
  b = jnp.floor((eps_points - left0) / h).astype(jnp.int64)
  exponent = jnp.where(b < 0, eps_points - left0 + rel[0], rel[jnp.clip(b, 0, n - 1)])
  b = jnp.clip(b, 0, n)
  kappa = 1.0 + 0.5 * jnp.expm1(-h)
  grid = jnp.maximum(mass[b] - kappa * jnp.exp(exponent) * scaled[b], 0.0)
  return jnp.minimum(_upper_delta(view, grid), support)


def upper_delta_curve(pld, eps_points):
  """The certified upper delta(eps) of a composed PLD (worse direction) at many points
  ``eps_points`` [K] in one O(N + K) pass (``delta_from_pld`` costs O(N) per point); each value
  is the upper at the grid boundary at or below its point, a bound from above (for a PLD kept
  as its band: at the point itself, O(band) each)."""
  view = {key: getattr(pld, key) for key in _VIEW}
  per_direction = jax.vmap(_upper_curve_direction, (0, None, None))(view, pld.plan,
                                                                   jnp.asarray(eps_points))
  return jnp.max(per_direction, axis=0)


def band_upper_curves(plds, plan, eps_points):
  """``upper_delta_curve`` of many PLDs kept as their bands, on one ``plan``, at shared points:
  ``plds`` is a PLD whose fields have a leading batch axis ([B, D, ...]; as a ``lax.map`` stacks
  them, its own plan's leaves too: ``plan`` is read instead); returns [B, P].

  Each point is read at the boundary at or above it, J = C_p - start (C_p = ceil((eps_p - s)/h
  + 1/2), s the upper placement's shift: an integer offset from the window's first cell, equal
  to ``_SpectralSums.delta``'s float one except within round-off of a boundary, where delta is
  continuous). Its powers factor as z^(J k) = z^(C_p k) z^(-start k): one product of a fixed
  [P, band] matrix with every PLD's coefficients (a matrix product over the batch) instead of
  O(band) lookups per point and PLD. J = 0 or N (beyond the window) has z^J = 1. A power is
  two table values' product times another (~2 ulps more than ``_powers``), inside the band
  sums' round-off allowance of 32 ulps a term (``spectrum.band_materialise``); measured, the
  curves differ from ``upper_delta_curve``'s by < 0.3% of the PLD's ``fft_error``."""
  h, n = jax.lax.stop_gradient(plan.grid_step), plan.fft_size
  band = plds.band                                                        # [B, D, K]
  count = band.shape[-1]
  sums = jax.vmap(jax.vmap(lambda b: _SpectralSums.of(b, h, n)))(band)
  shift = _shifts(h)[2]
  offsets = jnp.ceil((eps_points - shift) / h + 0.5).astype(jnp.int64)  # [P]
  boundary = offsets - plds.start[..., None]                              # [B, D, P]
  inside = (boundary > 0) & (boundary < n)
  j = jnp.clip(boundary, 0, n)
  unwound = sums.coef * jnp.conj(_powers(plds.start, count, n))[..., None]   # [B, D, K, 3]
  fixed = _powers(offsets, count, n)
  # As two real products: with the complex one, the per-example report's chunks run from two
  # threads returned wrong curves (~0.2 where the truth is ~1e-13) for some rows, the same rows
  # every run, and none from one thread (not found in an isolated product; cause unknown).
  read = (jnp.einsum("pk,bdkc->bdpc", jnp.real(fixed), jnp.real(unwound))
          - jnp.einsum("pk,bdkc->bdpc", jnp.imag(fixed), jnp.imag(unwound)))
  ends = jnp.real(jnp.sum(sums.coef, axis=-2))[..., None, :]              # z^J = 1
  parts = jax.vmap(jax.vmap(_SpectralSums.parts))(
      sums, j, jnp.where(inside[..., None], read, ends))
  left0 = plds.start.astype(jnp.float64) * h + shift - 0.5 * h
  delta_from = jax.vmap(jax.vmap(_SpectralSums.delta_from, (0, 0, None, 0, 0)), (0, 0, None, 0, 0))
  grid = delta_from(sums, left0, eps_points, j, parts)
  view = {key: getattr(plds, key)[..., None] for key in _VIEW if key not in ("pmf", "band")}
  upper = jnp.minimum(_upper_delta(view, jnp.maximum(grid, 0.0)), _support_delta(view,
                                                                                  eps_points))
  return jnp.max(upper, axis=1)


_VIEW = ("pmf", "band", "start", "window_above", "window_below", "fft_error", "mass_error",
         "status", "log_finite", "tail", "moved", "bias", "total_count", "loss_top")


def _worst_direction(pld, fn, arg):
  """Runs ``fn`` on every direction and keeps the worse guarantee. The directions, like a
  direction's three roots, are a loop (``lax.map``), not a vmap: its body is traced once as it
  is, and the query's program traces in ~0.15 s, not ~0.36 s, and compiles ~0.15 s sooner at
  the same run time (12-05, the default DP-SGD setting at T = 10^4)."""
  view = {key: getattr(pld, key) for key in _VIEW}
  return results.worst_over(jax.lax.map(lambda v: fn(v, pld.plan, arg), view))


def epsilon_from_pld(pld, delta) -> Bounds:
  """Certified epsilon(delta) of a composed PLD; vectorised over the shape of ``delta``."""
  delta = jnp.asarray(delta, dtype=jnp.float64)
  one = lambda d: _worst_direction(pld, _epsilon_direction, d)
  return jnp.vectorize(one, signature="()->()")(delta) if delta.ndim else one(delta)


def delta_from_pld(pld, epsilon) -> Bounds:
  """Certified delta(epsilon) of a composed PLD; vectorised over the shape of ``epsilon``."""
  epsilon = jnp.asarray(epsilon, dtype=jnp.float64)
  one = lambda e: _worst_direction(pld, _delta_direction, e)
  return jnp.vectorize(one, signature="()->()")(epsilon) if epsilon.ndim else one(epsilon)
