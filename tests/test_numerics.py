"""Numerical building blocks: the certified FFT error bound against a long-double composition of
the same steps, batching, tail sums and the low band of the spectrum."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxacct
from jaxacct.pld import discretise, distribution, query, spectrum
from jaxacct._batch import vectorised
from jaxacct._numerics import release_programs

CASES = [  # composition, smallest delta
    ([(jaxacct.Gaussian(50.0), 100_000)], 1e-7),
    ([(jaxacct.PoissonSampled(jaxacct.Gaussian(1.0), 0.01), 10_000)], 1e-5),
    ([(jaxacct.PureDP(0.1), 400)], 1e-6),
    ([(jaxacct.PoissonSampled(jaxacct.Gaussian(0.8), 0.1), 300),
      (jaxacct.Laplace(2.0), 50)], 1e-8),
]


def _long_double_composition(composition, plan, pld_, direction):
  """The same per-step pmfs, composed and windowed like distribution.compose, in numpy long
  double."""
  n = plan.fft_size
  spectrum = np.ones(n // 2 + 1, dtype=np.clongdouble)
  base = 0
  with jax.enable_x64(True):
    for mech, count in zip(composition.mechanisms, composition.counts):
      step = discretise.discretise(mech, jnp.float64(direction), plan)
      x = np.zeros(n, dtype=np.longdouble)
      x[:plan.per_step_size] = np.asarray(step.pmf, dtype=np.longdouble)
      spectrum = spectrum * np.fft.rfft(x) ** int(count)
      base += int(count) * int(step.start)
  circular = np.fft.irfft(spectrum, n=n)
  return np.roll(circular, -((int(pld_.start[direction]) - base) % n))


@pytest.mark.slow
@pytest.mark.parametrize("entries, delta", CASES)
def test_fft_error_bound_holds(entries, delta):
  comp = jaxacct.Composition.of(*entries)
  plan = jaxacct.make_plan(comp, delta)
  composed = jaxacct.compose(comp, plan=plan)
  for direction in range(composed.pmf.shape[0]):
    exact = _long_double_composition(comp, plan, composed, direction)
    ours = np.asarray(composed.pmf[direction], dtype=np.longdouble)
    error = float(np.sum(np.abs(ours - exact)))
    total_mass = float(np.sum(exact))
    bound = (float(composed.fft_error[direction])
             + float(composed.mass_error[direction]) * total_mass)
    assert error <= bound, (direction, error, bound)


def test_vectorised_batches_in_padded_blocks():
  """Full blocks plus a power-of-two padded remainder give the elementwise values, any shape."""
  # Programs compiled by earlier tests in this process are dropped first: past PROGRAM_BUDGET the
  # next call would drop this test's programs too, and count their traces again.
  release_programs(0)
  calls = []

  def single(comp, x):
    calls.append(1)  # one entry per trace, i.e. per compiled program
    return {"y": comp["a"] * jnp.sin(x) + comp["b"]}

  run = vectorised(single, chunk=4)
  with jax.enable_x64(True):
    x = np.linspace(0.1, 2.0, 11)
    comp = {"a": np.arange(11.0), "b": 0.5}
    got = np.asarray(run(comp, x)["y"])
    np.testing.assert_allclose(got, np.arange(11.0) * np.sin(x) + 0.5, rtol=1e-15)
    assert float(run(comp | {"a": 2.0}, 0.3)["y"]) == pytest.approx(2 * np.sin(0.3) + 0.5)
    grid = np.asarray(run({"a": np.ones((2, 1)), "b": 0.0}, np.ones((1, 3)))["y"])
    np.testing.assert_allclose(grid, np.full((2, 3), np.sin(1.0)), rtol=1e-15)
  assert len(calls) == 3  # the scalar, blocks of 4 (remainder 3 padded to 4) and a block of 2


@pytest.mark.parametrize("n", [7, 32, 33, 100, 512, 640, 2048, 3000])
def test_suffix_sums_match_numpy(n):
  """Every path: one triangular product (n <= 32), products within blocks of 32 and over the
  blocks after each (n <= 2048; the query's rows of 512 and block sums of 640), and a reversed
  cumulative sum."""
  x = np.random.default_rng(n).exponential(size=(2, n)) * np.logspace(-200, 0, n)
  with jax.enable_x64(True):
    got = np.asarray(query._suffix_sums(jnp.asarray(x)))
  expected = np.cumsum(x[:, ::-1].astype(np.longdouble), 1)[:, ::-1].astype(np.float64)
  np.testing.assert_allclose(got, expected, rtol=1e-13, atol=0.0)


@pytest.mark.parametrize("triangle_max", [2048, 4])
def test_tail_sums_find_the_crossing_cell(monkeypatch, triangle_max):
  """d(b) = sum_{j >= b} pmf_j (1 - kappa e^{(b - j) h}), kappa = (1 + e^{-h})/2 (each mass
  spread over its cell uniformly in e^{-y}), at every boundary, and the cell where it crosses a
  target, against a long-double sum (block sums by either suffix-sum path)."""
  monkeypatch.setattr(query, "_TRIANGLE_MAX", triangle_max)
  n, h = 5000, 0.003
  j = np.arange(n)
  pmf = np.exp(-0.5 * ((j - 2100) / 400.0) ** 2)
  pmf /= pmf.sum()
  c = (1 + np.exp(-np.longdouble(h))) / 2
  lj = j.astype(np.longdouble)
  def d_exact(b):
    return float(np.sum(pmf[b:] * (1 - c * np.exp((b - lj[b:]) * h))))
  with jax.enable_x64(True):
    sums = query._TailSums.of(jnp.asarray(pmf), jnp.asarray(h))
    total, d0 = sums.delta_at_start()
    assert float(total) == pytest.approx(1.0, rel=1e-14)
    assert float(d0) == pytest.approx(d_exact(0), rel=1e-12)
    for target in [0.3, 1e-3, 1e-9, 1e-30]:
      k, i, (d_i, d_next), mass, weighted, p_i = sums.crossing(jnp.asarray(target))
      k, i = int(k), int(i)
      assert d_exact(k - 1) > target >= d_exact(k)  # the first boundary with d <= target
      assert i == k - 1 and float(p_i) == pmf[i]
      assert float(d_i) == pytest.approx(d_exact(i), rel=1e-9, abs=1e-300)
      assert float(d_next) == pytest.approx(d_exact(i + 1), rel=1e-9, abs=1e-300)
      assert float(mass) == pytest.approx(float(np.sum(pmf[i + 1:])), rel=1e-12)
      assert float(mass - weighted) == pytest.approx(d_exact(i + 1), rel=1e-9, abs=1e-300)


def _tail_deltas(pmf, h):
  """d(b) at every boundary b = 0..n of a pmf (masses spread over their cells uniformly in
  e^{-y}), in long double: sum_{j >= b} pmf_j - kappa e^{b h} sum_{j >= b} pmf_j e^{-j h}."""
  p = pmf.astype(np.longdouble)
  j = np.arange(p.size, dtype=np.longdouble)
  suffix = lambda x: np.concatenate([np.cumsum(x[::-1])[::-1], np.zeros(1, np.longdouble)])
  kappa = (1 + np.exp(-np.longdouble(h))) / 2
  b = np.arange(p.size + 1, dtype=np.longdouble)
  return suffix(p) - kappa * np.exp(b * h) * suffix(p * np.exp(-j * h))


@pytest.mark.parametrize("offsets", [(-2, 0, 3), (-30, 0, 40), (-700, 0, 900), (-10**6, 0, 800),
                                     (400, 0, -50), (-3, 0, 1400)])
def test_spectral_sums_find_each_targets_crossing(offsets):
  """A band's crossings of three targets at once (the middle one bisected, the others searched
  near it: within the first reach, the second, beyond both, on either side; a target above
  d(0) crosses at 0) against the first boundary where a long-double d of the pmf the band holds
  falls to each target, with the cell's values."""
  n, h = 5000, 0.003
  gauss = np.exp(-0.5 * ((np.arange(n) - 2500) / 250.0) ** 2)
  band = np.fft.rfft(gauss / gauss.sum())[:48] * np.where(np.arange(48) == 0, 1.0, 2.0) / n
  # The pmf the band holds exactly: p_j = Re sum_k band_k e^{2 pi i j k / n}.
  turns = np.outer(np.arange(n), np.arange(48)).astype(np.longdouble) % n / n
  pmf = np.sum(band.real * np.cos(2 * np.pi * turns) - band.imag * np.sin(2 * np.pi * turns),
               axis=1)
  d = _tail_deltas(pmf, h)
  anchor = 2600
  # Each target midway (in log) between d at its boundary and the one before: no round-off tie.
  at = lambda k: 2.0 if k <= 0 else float(np.sqrt(d[k - 1] * d[k]))
  targets = np.array([at(anchor + o) for o in offsets])
  with jax.enable_x64(True):
    sums = query._SpectralSums.of(jnp.asarray(band), jnp.asarray(h), n)
    ks, cells, (d_i, d_next), mass, weighted, p_i = sums.crossings(jnp.asarray(targets))
  # (the values within the band sums' round-off, ~1e-16 absolute here)
  for t, k, i, di, dn, m, w, p in zip(targets, ks, cells, d_i, d_next, mass, weighted, p_i):
    first = int(np.argmax(d <= t))
    assert int(k) == first, (t, int(k), first)
    if first == 0:
      continue
    assert int(i) == first - 1 and float(p) == pytest.approx(float(pmf[first - 1]), rel=1e-9,
                                                                  abs=1e-18)
    assert float(di) == pytest.approx(float(d[first - 1]), rel=1e-9, abs=1e-15)
    assert float(dn) == pytest.approx(float(d[first]), rel=1e-9, abs=1e-15)
    assert float(m - w) == pytest.approx(float(d[first]), rel=1e-9, abs=1e-15)
    assert float(m) == pytest.approx(float(np.sum(pmf[first:])), rel=1e-9, abs=1e-15)


def test_counted_sums_skip_uncounted_entries_and_keep_infinities():
  """sum_j c_j x_j over the counted entries (c_j > 0) as a product, against the sum term by
  term: an uncounted infinite or nan adds nothing, a counted one makes the sum +-inf or nan
  (nan for both signs); batched over count vectors too."""
  rng = np.random.default_rng(3)
  x = rng.normal(size=(6, 4))
  x[1, 0], x[2, 1], x[3, 1], x[4, 2], x[5, 3] = np.inf, np.inf, -np.inf, np.nan, -np.inf
  counts = rng.integers(0, 4, size=(64, 6)).astype(np.float64)
  counts[::3, 5] = 0
  with jax.enable_x64(True):
    got = np.asarray(jax.vmap(lambda c: spectrum._counted_sum(c, jnp.asarray(x)))(counts))
  for c, row in zip(counts, got):
    used = c > 0
    with np.errstate(invalid="ignore"):
      want = np.sum(c[used, None] * x[used], axis=0)
    np.testing.assert_allclose(row, want, rtol=1e-14)


def test_loss_top_bounds_the_counted_losses_and_ignores_uncounted_unbounded_ones():
  """sum_j c_j max_loss_j rounded up (never below the long-double sum, within a few ulps of it),
  +inf exactly where a counted entry's loss is unbounded (inf or nan), whatever an uncounted
  entry holds; batched over count vectors too."""
  rng = np.random.default_rng(5)
  max_loss = rng.uniform(-3.0, 40.0, size=7)
  max_loss[2], max_loss[5] = np.inf, np.nan
  counts = rng.integers(0, 1000, size=(64, 7)).astype(np.float64)
  counts[::2, 2] = 0
  counts[::3, 5] = 0
  with jax.enable_x64(True):
    got = np.asarray(jax.vmap(lambda c: spectrum._loss_top(c, jnp.asarray(max_loss)))(counts))
  for c, top in zip(counts, got):
    used = c > 0
    if not np.all(np.isfinite(max_loss[used])):
      assert top == np.inf
      continue
    exact = np.sum(c[used].astype(np.longdouble) * max_loss[used].astype(np.longdouble))
    assert top >= exact
    assert top - exact <= 1e-14 * np.sum(c[used] * np.abs(max_loss[used]))


@pytest.mark.parametrize("gap", [0.5, 1e-5, 1e-10])
def test_epsilon_below_the_grid_is_rounded_to_the_safe_side(gap):
  """A target above delta(first boundary) puts epsilon below the grid, where delta = total -
  e^{eps - left} (total - d0) in closed form: the upper side's root is >= the long-double root
  and the lower side's <= it, also where total - target is small (round-off amplified)."""
  n, h, first = 3000, 0.004, -2.0
  pmf = np.exp(-0.5 * ((np.arange(n) - 1400) / 300.0) ** 2)
  pmf /= pmf.sum()
  j = np.arange(n, dtype=np.longdouble)
  c = (1 + np.exp(-np.longdouble(h))) / 2
  total = np.sum(pmf.astype(np.longdouble))
  d0 = np.sum(pmf * (1 - c * np.exp(-j * h)))
  target = float(total - gap * (total - d0))  # (total - target) / (total - d0) = gap
  left = np.longdouble(first) - h / 2
  exact = float(left + np.log((total - np.longdouble(target)) / (total - d0)))
  with jax.enable_x64(True):
    sums = query._TailSums.of(jnp.asarray(pmf), jnp.asarray(h))
    start = sums.delta_at_start()
    grid_delta = lambda centre, eps: query._delta_on_grid(jnp.asarray(pmf), centre, h, eps)

    def root(side, goal=target):
      goal = jnp.asarray(goal)
      crossing = sums.crossing(query._solvable(goal, start[1]))
      return float(query._epsilon_on_grid(grid_delta, crossing, start, jnp.asarray(first),
                                          jnp.asarray(h), goal, side))
    upper, estimate, lower = root(1.0), root(0.0), root(-1.0)
    assert lower <= exact <= upper
    # A target above the total mass: no finite root, and no NaN.
    assert [root(side, 1.5) for side in (1.0, 0.0, -1.0)] == [-np.inf] * 3
  rounding = np.finfo(np.float64).eps * (1 + abs(exact) + 2 / (gap * float(total - d0)))
  assert upper - lower <= 20 * rounding
  assert estimate == pytest.approx(exact, abs=20 * rounding)


@pytest.mark.parametrize("n,k0,block", [(4096, 40, 3), (256, 60, 1), (1024, 97, 1)])
def test_low_band_spectrum_matches_a_direct_dft(n, k0, block):
  """log F'_k of the direct low-band sums against a long-double DFT, on the single-pass path
  (k0 <= n / blocks) and the chunked one that bounds memory (k0 > n / blocks, padded or not)."""
  rng = np.random.default_rng(n + k0)
  pmf = rng.exponential(size=200) * np.exp(-0.5 * ((np.arange(200) - 90) / 25.0) ** 2)
  with jax.enable_x64(True):
    log_f, centre, _ = spectrum.low_log_spectrum(jnp.asarray(pmf), n, k0, block)
  j = np.arange(200, dtype=np.longdouble)
  k = np.arange(k0, dtype=np.longdouble)[:, None]
  angle = -2 * np.pi * k * (j[None, :] - int(centre)) / n  # F'_k: F_k without the centre's phase
  expected = (np.sum(pmf * np.cos(angle), 1)
              + 1j * np.sum(pmf * np.sin(angle), 1)).astype(complex)
  np.testing.assert_allclose(np.exp(np.asarray(log_f)), expected, rtol=1e-12, atol=1e-13)


def _test_pmf(kind, m, rng):
  """A step's pmf of mass 1 on m points: smooth and narrow, spread wide, point masses at both
  ends (a Laplace step's atoms), or rough."""
  j = np.arange(m)
  if kind == "narrow":
    pmf = np.exp(-0.5 * ((j - 0.3 * m) / (0.01 * m)) ** 2) * (1 + 0.1 * rng.random(m))
  elif kind == "wide":
    pmf = np.exp(-0.5 * ((j - 0.5 * m) / (0.15 * m)) ** 2)
  elif kind == "atoms":
    pmf = 1e-3 * rng.random(m)
    pmf[0], pmf[-1] = 0.4, 0.3
  else:
    pmf = rng.exponential(size=m) ** 4
  return pmf / np.sum(pmf)


@pytest.mark.parametrize("n,band,m,kind", [
    (327_680, 192, 73_728, "narrow"), (327_680, 192, 73_728, "atoms"),
    (3_145_728, 192, 2_000, "wide"), (98_304, 256, 108, "atoms"), (221_184, 216, 3_072, "rough"),
    (24_576, 256, 9_216, "narrow")])
def test_band_transform_is_within_its_bound_of_a_long_double_dft(n, band, m, kind):
  """The band's coefficients from block moments and small FFTs (``spectrum.band_transform``)
  against a long-double DFT at frequencies across the band, within the bound it reports, which
  stays far below the mass; and the bound on the largest |F_k| above the band from the step's
  own-length FFT (``_largest_above_band``) is at least the maximum over the whole grid's FFT."""
  rng = np.random.default_rng(n + m)
  pmf = _test_pmf(kind, m, rng)
  block = spectrum.band_block(n, band)
  with jax.enable_x64(True):
    value, error = jax.jit(lambda p: spectrum.band_transform(p, n, band))(jnp.asarray(pmf))
  k = np.unique(np.r_[0, 1, band - 1, rng.integers(0, band, 8)])
  j = np.arange(m, dtype=np.int64)
  turns = ((j[None, :] * k[:, None]) % n).astype(np.longdouble) / n
  angle = 2 * np.pi * turns
  exact = (np.sum(pmf * np.cos(angle), 1) - 1j * np.sum(pmf * np.sin(angle), 1)).astype(complex)
  assert np.all(np.abs(np.asarray(value)[k] - exact) <= float(error)), (block, float(error))
  assert float(error) <= 1e-11
  whole = np.fft.rfft(pmf, n=n)
  if block >= 16:  # (the bound above the band, where band-only terms are used)
    centre = jnp.asarray(int(np.round(np.sum(j * pmf))))
    sizes = types.SimpleNamespace(fft_size=n, band=band)  # (all the bound reads of a plan)
    with jax.enable_x64(True):
      largest = float(spectrum._largest_above_band(jnp.asarray(pmf), sizes, centre))
    assert largest >= np.max(np.abs(whole[band:]))


def test_band_only_terms_answer_as_the_whole_grid_transform_does():
  """A PLD kept as its band from band-only terms (no FFT of the plan's size) has the bounds of
  one from the whole grid's transform: where the band-only terms serve (DP-SGD at T = 10^4),
  where their bound above the band is too loose (a Laplace step's atoms keep |F| near 1), and
  where their values' allowance would loosen the bounds (one Gaussian step beside DP-SGD's:
  its low band is read from the transform, powered 10^4 times). In the last two the same
  program takes the steps' FFTs of the plan's size."""
  def answer(band_only):
    def run(comp, delta, plan):
      terms = spectrum.entry_terms_by_direction(comp.mechanisms, spectrum.directions(comp), plan,
                                                band_only=band_only)
      fields = spectrum.band_fields_from_terms(terms, comp.counts, plan)
      pld = distribution.PrivacyLossDistribution(plan=plan, **fields)
      serves = jnp.zeros(2, bool)
      if band_only:
        acc, rounded = jax.vmap(spectrum._accumulate, in_axes=(0, None, None))(
            terms, jnp.asarray(comp.counts, jnp.float64), plan)
        serves = jnp.stack(spectrum._band_only_serves(acc, terms, rounded, plan))
      return query.epsilon_from_pld(pld, delta), serves
    return jax.jit(run)

  dpsgd = jaxacct.PoissonSampled(jaxacct.Gaussian(1.0), 0.01)
  settings = [  # (composition, the band-only bound above the band suffices, the error share)
      (jaxacct.Composition.of((dpsgd, 10_000)), True, True),
      (jaxacct.Composition.of((jaxacct.Laplace(40.0), 14_292)), False, True),
      (jaxacct.Composition.of((dpsgd, 10_000), (jaxacct.Gaussian(2.0), 1)), True, False)]
  with jax.enable_x64(True):
    for comp, above, values in settings:
      plan = jaxacct.make_plan(comp, 1e-5)
      assert spectrum.band_block(plan.fft_size, plan.band) >= 16
      assert 2 * plan.per_step_size <= plan.fft_size
      (whole, _), (band, serves) = (answer(b)(comp, 1e-5, plan) for b in (False, True))
      assert [bool(v) for v in serves] == [above, values]
      assert int(band.status) == int(whole.status) == 0
      for name in ("lower", "estimate", "upper"):
        assert float(getattr(band, name)) == pytest.approx(float(getattr(whole, name)),
                                                           rel=1e-12)


def test_a_wide_sweep_plan_runs_the_low_band_in_chunks():
  """A plan for a sweep takes the finest grid of one setting and the widest window of another;
  its low band then has k0 x blocks >> n (at q 1e-3 vs 0.39 and 1e-10, ~50 GB in one pass). The
  sweep runs it in chunks; its brackets and each setting's own must both hold the truth."""
  with jax.enable_x64(True):
    scale, rate, count = [13.0, 2.0], [0.001, 0.3], [10.0, 2.0]
    comp = jaxacct.Composition.of((jaxacct.PoissonSampled(
        jaxacct.Laplace(jnp.array(scale)), jnp.array(rate)), jnp.array(count)))
    plan = jaxacct.make_plan(comp, 1e-6)
    assert plan.low_frequencies * (plan.per_step_size // plan.block) > 100 * plan.fft_size
    # Compiled working memory of one setting: a few dozen arrays of the FFT's length (one pass
    # would need ~2000).
    one = jaxacct.Composition.of((jaxacct.PoissonSampled(jaxacct.Laplace(2.0), 0.3), 2.0))
    one = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), one)
    memory = jax.jit(lambda c: distribution.compose(c, plan)).lower(one).compile().memory_analysis()
    assert memory.temp_size_in_bytes <= 100 * 8 * plan.fft_size
    swept = jaxacct.epsilon(comp, 1e-6, plan=plan)
    for i in range(2):
      alone = jaxacct.epsilon(jaxacct.Composition.of((jaxacct.PoissonSampled(
          jaxacct.Laplace(scale[i]), rate[i]), count[i])), 1e-6)
      assert int(swept.status[i]) == 0 and int(alone.status) == 0
      assert float(swept.lower[i]) <= float(alone.upper)
      assert float(alone.lower) <= float(swept.upper[i])
      assert float(alone.lower) <= float(swept.estimate[i]) <= float(alone.upper)


def test_nearby_settings_share_one_program_through_a_size_cache():
  """Settings planned one at a time with one SizeCache reuse static sizes that fit them (one
  compiled program for a sigma sweep over 25%); a reused plan's bracket agrees with the setting's
  own plan. Without a cache a plan depends only on its inputs, not on what was planned before."""
  cache = jaxacct.pld.SizeCache()
  sigmas = np.linspace(1.0, 1.25, 6)
  plans = [jaxacct.dpsgd_plan(s, 0.01, 1000, 1e-5, size_cache=cache) for s in sigmas]
  assert len({p.sizes for p in plans}) == 1
  reused = jaxacct.dpsgd_epsilon(sigmas[-1], 0.01, 1000, 1e-5, plan=plans[-1])
  own_plan = jaxacct.dpsgd_plan(sigmas[-1], 0.01, 1000, 1e-5)
  assert own_plan.fft_size < plans[-1].fft_size  # (a plan of its own)
  own = jaxacct.dpsgd_epsilon(sigmas[-1], 0.01, 1000, 1e-5, plan=own_plan)
  assert int(reused.status) == 0 and int(own.status) == 0
  assert float(reused.lower) <= float(own.upper) and float(own.lower) <= float(reused.upper)
  assert abs(float(reused.estimate) - float(own.estimate)) <= 1e-6
  # Also where the low band needs only a few coefficients (few steps).
  few = [jaxacct.dpsgd_plan(s, 1.0, 4, 1e-5, size_cache=cache) for s in sigmas]
  assert len({p.sizes for p in few}) == 1
  # No cache: the same inputs give the same plan whatever was planned before.
  alone = [jaxacct.dpsgd_plan(s, 0.01, 1000, 1e-5) for s in sigmas]
  assert alone[-1].sizes == own_plan.sizes
  assert [p.sizes for p in alone] == [jaxacct.dpsgd_plan(s, 0.01, 1000, 1e-5).sizes
                                      for s in sigmas[::-1]][::-1]


@pytest.mark.parametrize("h", [1e-4, 3e-3, 0.05])
def test_cell_spread_is_uniform_in_exp_minus_loss(h):
  """delta of one unit of mass spread over its cell, uniformly in u = e^{-y}, against a direct
  long-double average of (1 - e^{eps - y})_+; the spread that keeps the mean of e^{-y} (upper
  bound, estimate) is never below the point mass (Jensen), the one below the point (lower
  bound) never above, and both are continuous with a continuous slope in eps."""
  c = 0.3
  keep_mean = float(np.log1p(2.0 * np.sinh(0.25 * h) ** 2))
  u = np.linspace(0.0, 1.0, 200_001, dtype=np.longdouble)
  for shift, relation in ((keep_mean, 1), (-0.5 * h, -1)):
    left = np.longdouble(c + shift - 0.5 * h)
    us = np.exp(-left - h) + u * (np.exp(-left) - np.exp(-left - h))  # uniform in e^{-y}
    eps_grid = c + np.linspace(-3 * h, 3 * h, 61)
    with jax.enable_x64(True):
      got = np.array([float(query._delta_on_grid(jnp.array([1.0]), c + shift, h, e))
                      for e in eps_grid])
    for e, g in zip(eps_grid, got):
      direct = np.trapezoid(np.maximum(0.0, 1.0 - np.exp(np.longdouble(e)) * us), u)
      assert g == pytest.approx(float(direct), abs=1e-9)
      point = max(0.0, 1.0 - np.exp(e - c))
      assert (g >= point - 1e-15) if relation > 0 else (g <= point + 1e-15)
    # C^1: over steps of h/10 the slope turns by ~0.1 (a curvature ~1/h inside the cell); a
    # kink (as a point mass gives) would jump by ~1 at one step.
    slope = np.diff(got) / np.diff(eps_grid)
    assert np.max(np.abs(np.diff(slope))) <= 0.15 * np.max(np.abs(slope))


def test_host_erfc_and_sigmoid_match_scipy():
  """The planner's host erfc (libm's below ``_SCIPY_ERFC_SIZE`` values, scipy's above) and
  sigmoid (numpy) agree with scipy to round-off, over both signs and into the far tails (where
  scipy does not flush to zero)."""
  from scipy import special
  from jaxacct import _numerics
  x = np.concatenate([-np.geomspace(1e-300, 30.0, 401), [0.0], np.geomspace(1e-300, 26.0, 401)])
  small = _numerics.erfc(x)
  large = _numerics.erfc(np.resize(x, _numerics._SCIPY_ERFC_SIZE))[:x.size]
  for value in (small, large):
    np.testing.assert_allclose(value, special.erfc(x), rtol=2e-13, atol=0.0)
  assert _numerics.erfc(0.5) == pytest.approx(special.erfc(0.5), rel=1e-15)
  z = np.concatenate([-np.geomspace(1e-300, 700.0, 301), [0.0], np.geomspace(1e-300, 700.0, 301)])
  np.testing.assert_allclose(_numerics.sigmoid(z), special.expit(z), rtol=4e-16, atol=0.0)


def test_host_log_ndtr_and_logsumexp_against_mpmath():
  """The calibration's host log Phi (libm's erfc, the asymptotic series below -30) against
  40-digit mpmath, over both signs and far into the lower tail; its logsumexp (numpy) against
  mpmath's, with rows of -inf terms."""
  import mpmath
  from jaxacct._numerics import host_log_ndtr, host_logsumexp
  x = np.concatenate([-np.geomspace(1e-4, 1e5, 300), [0.0, -30.0, np.nextafter(-30.0, 0.0)],
                      np.geomspace(1e-4, 8.0, 100)])
  rows = np.random.default_rng(3).normal(scale=300.0, size=(6, 9))
  rows[0], rows[1, :5] = -np.inf, -np.inf
  with mpmath.workdps(40):
    ref = np.array([float(mpmath.log(mpmath.ncdf(mpmath.mpf(v)))) for v in x])
    sums = [float(mpmath.log(mpmath.fsum(mpmath.exp(mpmath.mpf(v)) for v in row)))
            if np.any(np.isfinite(row)) else -np.inf for row in rows]
  # (erfc's argument x/sqrt(2) is rounded: a relative 1e-16 there is ~x^2 1e-16 in the value;
  # the series, below -30, has no such argument)
  assert np.all(np.abs(host_log_ndtr(x) - ref) <= 4e-15 * (1.0 + np.minimum(x * x, 900.0))
                * np.abs(ref))
  assert host_log_ndtr(-np.inf) == -np.inf and host_log_ndtr(np.inf) == 0.0
  assert np.isnan(host_log_ndtr(np.nan))
  np.testing.assert_allclose(host_logsumexp(rows), sums, rtol=1e-15, atol=0.0)


@pytest.mark.parametrize("n", [7, 4096, 81_920, 327_680, 3_145_728])
def test_sin_cos_of_a_fraction_of_pi_is_accurate_to_its_own_size(n):
  """sin and cos of pi j / n (the low band's phases) against 40-digit mpmath, within 4 ulps of
  each value's own size: across many turns, and beside the zeros of either (where a rounded
  angle's reduction would leave only an absolute accuracy)."""
  import mpmath
  from jaxacct._numerics import sin_cos_pi_fraction
  rng = np.random.default_rng(n)
  near = np.concatenate([m * n / 2 + np.arange(-3, 4) for m in range(-4, 5)])
  j = np.unique(np.concatenate([np.round(near), rng.integers(-10**4 * n, 10**4 * n, 400)]))
  with jax.enable_x64(True):
    fn = jax.jit(sin_cos_pi_fraction, static_argnums=1)
    got = np.asarray(fn(jnp.asarray(j, jnp.float64), n))
  with mpmath.workdps(40):
    for index, whole in enumerate(j.astype(np.int64).tolist()):
      angle = mpmath.pi * whole / n
      for value, exact in zip(got[:, index], (mpmath.sin(angle), mpmath.cos(angle))):
        if abs(exact) < 1e-30:  # (an exact zero: the reduced angle is exactly 0)
          assert value == 0.0, (whole, n)
        else:
          assert abs(value - exact) <= 4 * np.finfo(np.float64).eps * abs(exact), (whole, n)


def _model_batches(n, seed):
  """Batches of every elementwise model (parameters across their range) and one that is not."""
  rng = np.random.default_rng(seed)
  u = lambda lo, hi: rng.uniform(lo, hi, n)
  return [jaxacct.Gaussian(u(0.2, 8.0)), jaxacct.Laplace(u(0.05, 5.0)),
          jaxacct.PoissonSampled(jaxacct.Gaussian(u(0.3, 6.0)), 10.0 ** u(-6, 0)),
          jaxacct.PoissonSampled(jaxacct.Laplace(u(0.1, 3.0)), 10.0 ** u(-4, 0)),
          jaxacct.SampledGaussianReplaceOne(u(0.3, 6.0), 10.0 ** u(-6, 0)),
          jaxacct.MixtureOfGaussians(u(0.5, 4.0), np.tile([0.0, 1.0, 2.0], (n, 1)),
                                     np.tile([0.5, 0.3, 0.2], (n, 1)))]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_planner_reads_a_batch_of_elementwise_models_in_one_call(seed):
  """A model that ``broadcasts`` (its cdf_sf and loss_range elementwise in its parameters) is
  evaluated for the planner's whole block of settings at once: exactly the values it gives one
  setting at a time, as the accountant evaluates it; a model that does not (a mixture's
  components are vectors) is still read one setting at a time."""
  from jaxacct import _batch
  from jaxacct.pld import plan as _plan
  n = 9
  for mech in _model_batches(n, seed):
    assert mech.broadcasts() == (not isinstance(mech, jaxacct.MixtureOfGaussians))
    flat, _ = _batch.flatten(jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), mech))
    for add in (0.0, 1.0):
      flags = np.full(n, add)
      log_tail = np.linspace(-60.0, -5.0, n)
      t = np.linspace(-8.0, 8.0, 257) * np.geomspace(0.01, 3.0, n)[:, None]
      for method, args in (("loss_range", (log_tail, flags)), ("cdf_sf", (t, flags))):
        got = _plan._per_setting(flat, method, args)
        for i in range(n):
          one = getattr(_batch.take(flat, i), method)(*(a[i] for a in args))
          expected = np.stack([np.broadcast_to(np.asarray(v, np.float64), np.shape(args[0][i]))
                               for v in one])
          np.testing.assert_array_equal(got[i], expected)


def test_group_plans_are_each_groups_own_plan():
  """``plan.group_plans`` gives each group of a batch the plan ``make_plan`` gives it alone (its
  models read once for the groups that share their smallest delta and counts), and the
  planner's refusal as the error it raises alone."""
  from jaxacct.composition import checked
  from jaxacct.pld import plan as _plan
  rng = np.random.default_rng(3)
  k = 7
  sigma = np.concatenate([rng.uniform(0.5, 3.0, 2 * k), [0.01, 0.02]])
  q = np.concatenate([10.0 ** rng.uniform(-4, -0.5, 2 * k), [0.5, 0.5]])
  steps = np.concatenate([np.tile([1000.0, 1000.0, 50.0, 1000.0, 20_000.0, 1000.0, 3.0], 2),
                          [10.0**6, 10.0**6]])
  delta = np.concatenate([np.tile([1e-5, 1e-5, 1e-8, 1e-5, 1e-5, 1e-10, 1e-5], 2),
                          [1e-5, 1e-5]])
  comp = lambda idx: checked(jaxacct.Composition.of(
      (jaxacct.PoissonSampled(jaxacct.Gaussian(sigma[idx]), q[idx]), steps[idx])),
      integer_counts=True)
  groups = [np.array([i, i + k]) for i in range(k)] + [np.array([2 * k, 2 * k + 1])]
  plans = _plan.group_plans(comp(np.arange(sigma.size)), delta, groups)
  for group, plan in zip(groups, plans):
    try:
      alone = _plan.make_plan(comp(group), delta[group])
    except ValueError as error:
      assert isinstance(plan, ValueError) and str(plan) == str(error)
      continue
    assert plan.sizes == alone.sizes
    for got, expected in zip(jax.tree_util.tree_leaves(plan), jax.tree_util.tree_leaves(alone)):
      np.testing.assert_array_equal(got, expected)
  assert isinstance(plans[-1], ValueError)  # (a loss spanning more than float64 serves)


def test_a_batch_answers_each_setting_as_it_would_alone_on_its_plan_row():
  """On CPU a batch of small plans runs the single-setting program once a setting (a host loop:
  faster there than one mapped program): each answer is the setting's own on its row of the
  batch's plan, and agrees with the mapped program to round-off."""
  from jaxacct import _batch
  from jaxacct.pld import accountant, plan as _plan
  sigmas = np.array([0.7, 0.9, 1.2, 1.6])
  comp = jaxacct.Composition.of((jaxacct.PoissonSampled(jaxacct.Gaussian(sigmas), 0.01), 500))
  batch = jaxacct.epsilon(comp, 1e-5)
  with jax.enable_x64(True):
    flat = _batch.flatten((comp, np.full(sigmas.size, 1e-5)))[0]
    plan = _plan.batch_plan(flat[0], flat[1])
    assert plan.fft_size <= accountant._LOOP_MAX_FFT and np.ndim(plan.grid_step) == 1
    mapped = accountant._RUNNERS["epsilon"][1](*flat, plan, 1)
  for i, sigma in enumerate(sigmas):
    alone = jaxacct.epsilon(jaxacct.Composition.of(
        (jaxacct.PoissonSampled(jaxacct.Gaussian(sigma), 0.01), 500)), 1e-5,
        plan=_batch.take(plan, i))
    for name in ("lower", "estimate", "upper", "status"):
      assert np.asarray(getattr(batch, name))[i] == np.asarray(getattr(alone, name))
  for name in ("lower", "estimate", "upper"):
    np.testing.assert_allclose(getattr(batch, name), getattr(mapped, name), rtol=1e-12)


def test_one_setting_runs_as_two_programs_unless_its_query_would_fault_in_its_memory(
    monkeypatch):
  """On CPU the front door composes and queries one setting as two programs (with the cache on,
  compiled side by side for a first answer: test_cli) unless the query's temporaries alone would
  pass glibc's 32 MiB (a Gaussian composed 10^4 times at sigma 20: 1,310,720 grid points);
  either way the answer is the single program's, bit for bit (epsilon of DP-SGD, delta of a
  symmetric composition of two entries), and under a caller's grad the one program is traced."""
  from jaxacct.pld import accountant
  with jax.enable_x64(True):
    small = jaxacct.dpsgd_composition(1.0, 0.01, 1_000)
    assert accountant._in_two_programs(small, jaxacct.make_plan(small, 1e-5)) == (
        jax.default_backend() == "cpu")
    wide = jaxacct.Composition.of((jaxacct.Gaussian(20.0), 10_000))
    assert not accountant._in_two_programs(wide, jaxacct.make_plan(wide, 1e-5))
  cases = [(small, "epsilon", 1e-5),
           (jaxacct.Composition.of((jaxacct.Gaussian(3.0), 20), (jaxacct.Laplace(40.0), 3)),
            "delta", 2.0)]
  for comp, quantity, x in cases:
    answers = []
    for two in (True, False):
      asked = []
      monkeypatch.setattr(accountant, "_in_two_programs",
                          lambda composition, plan, two=two: asked.append(two) or two)
      answers.append(getattr(jaxacct.pld, quantity)(comp, x))
      assert asked == [two]
    assert float(answers[0].upper) > 0
    for name in ("lower", "estimate", "upper", "status"):
      assert np.asarray(getattr(answers[0], name)) == np.asarray(getattr(answers[1], name))
  # Under a caller's grad the one function is traced, whatever the size (the two halves' rules
  # would meet the PLD's integer fields: an error, not a slope).
  monkeypatch.setattr(accountant, "_in_two_programs", lambda composition, plan: True)
  plan = jaxacct.dpsgd_plan(1.0, 0.01, 1_000, 1e-5)
  slope = jax.jit(jax.grad(lambda s: jaxacct.dpsgd_epsilon(s, 0.01, 1_000, 1e-5,
                                                           plan=plan).upper))(1.0)
  assert -np.inf < float(slope) < 0


def test_a_large_setting_is_answered_from_its_band_and_in_full_where_that_is_loose(monkeypatch):
  """On CPU the front door answers one setting whose single program's temporaries pass glibc's
  32 MiB from its PLD kept as its band (no inverse transform, each delta in O(band)): here a
  Gaussian mechanism composed 10^4 times (sigma 20), whose epsilon and delta are the mu-GDP
  curve's (the bracket holds the exact value, the upper within the bracket's width), with the
  full PLD's bounds to 1e-8 relative. A band answer flagged loose (spectrum above the band not
  negligible) is answered in full instead. A batch of such settings runs the band's program once
  a setting from the host (a loop, not one mapped program: 12 settings at T = 10^4, 0.50 against
  0.92 s), each queued call answering as one call alone on its plan does."""
  import math
  from conftest import gaussian_delta, gaussian_epsilon
  from jaxacct import _batch
  from jaxacct.pld import accountant, plan as _plan
  steps, sigma = 10_000, 20.0  # (1,310,720 grid points: too many for the two programs' rule)
  gauss = jaxacct.Composition.of((jaxacct.Gaussian(sigma), steps))
  mu = math.sqrt(steps) / sigma
  with jax.enable_x64(True):
    plan = jaxacct.make_plan(gauss, 1e-5)
    assert accountant._as_band(gauss, plan) == (jax.default_backend() == "cpu")
    small = jaxacct.dpsgd_composition(1.0, 0.01, 1_000)
    assert not accountant._as_band(small, jaxacct.make_plan(small, 1e-5))
    # (at delta 1e-10 the band sums' round-off would loosen the bounds: answered in full)
    assert not accountant._as_band(gauss, jaxacct.make_plan(gauss, 1e-10))
  answers = {}
  for band in (True, False):
    monkeypatch.setattr(accountant, "_as_band", lambda c, p, band=band: band)
    answers[band] = (jaxacct.pld.epsilon(gauss, 1e-5), jaxacct.pld.delta(gauss, 1.0))
  monkeypatch.undo()
  (eps, delta), (full_eps, full_delta) = answers[True], answers[False]
  with accountant.answering_once():  # (the command line's one question: no band program)
    with jax.enable_x64(True):
      assert not accountant._as_band(gauss, plan)
    once = jaxacct.pld.epsilon(gauss, 1e-5)
  with jax.enable_x64(True):  # (the context ends with its block)
    assert accountant._as_band(gauss, plan) == (jax.default_backend() == "cpu")
  # (its programs compiled at XLA's lowest back-end level there: the same to round-off)
  np.testing.assert_allclose([float(once.lower), float(once.upper)],
                             [float(full_eps.lower), float(full_eps.upper)], rtol=1e-10, atol=0)
  exact_eps, exact_delta = gaussian_epsilon(1e-5, mu), gaussian_delta(1.0, mu)
  assert float(eps.lower) <= exact_eps <= float(eps.upper) <= exact_eps + 0.03
  assert float(delta.lower) <= exact_delta <= float(delta.upper) <= exact_delta * 1.05
  for got, full in ((eps, full_eps), (delta, full_delta)):
    assert int(got.status) == int(full.status) == 0
    for name in ("lower", "estimate", "upper"):
      assert float(getattr(got, name)) == pytest.approx(float(getattr(full, name)), rel=1e-8)
  looped, loop = [], accountant._looped
  monkeypatch.setattr(accountant, "_looped", lambda *a: looped.append(1) or loop(*a))
  sigmas = np.array([sigma, 21.0])
  batch = jaxacct.pld.epsilon(jaxacct.Composition.of((jaxacct.Gaussian(sigmas), steps)), 1e-5)
  monkeypatch.undo()
  assert looped == ([1] if jax.default_backend() == "cpu" else [])
  with jax.enable_x64(True):
    flat = _batch.flatten((jaxacct.Composition.of((jaxacct.Gaussian(sigmas), steps)),
                           np.full(2, 1e-5)))[0]
    rows = _plan.batch_plan(flat[0], flat[1])
  for i, s in enumerate(sigmas):
    exact = gaussian_epsilon(1e-5, math.sqrt(steps) / s)
    assert float(batch.lower[i]) <= exact <= float(batch.upper[i]) <= exact + 0.03
    # (the queued calls answer as one call alone on the row's plan does, bit for bit)
    alone = jaxacct.pld.epsilon(jaxacct.Composition.of((jaxacct.Gaussian(s), steps)), 1e-5,
                                plan=_batch.take(rows, i) if np.ndim(rows.grid_step) else rows)
    assert float(alone.upper) == float(batch.upper[i])
  one = accountant.single_program("epsilon")
  stand_in = jaxacct.Bounds(*(np.float64(0.0),) * 3, np.int32(0))
  with jax.enable_x64(True):
    assert one.finish((stand_in, np.bool_(True)), gauss, np.float64(1e-5), plan) is stand_in
    rerun = one.finish((stand_in, np.bool_(False)), gauss, np.float64(1e-5), plan)
  assert float(rerun.upper) == float(full_eps.upper) and float(rerun.lower) == float(
      full_eps.lower)


def test_a_worker_thread_runs_float64_on_the_device_it_is_given():
  """``threaded_call`` in a worker thread (where neither the caller's float64 scope nor its
  default device reach): float64 there, and the device it is given is the default one (none
  given: JAX's own default, unset)."""
  import concurrent.futures
  from jaxacct._numerics import threaded_call
  seen = lambda: np.asarray([str(jax.config.jax_default_device),
                             str(jnp.zeros(()).dtype)])
  device = jax.devices()[0]
  with jax.default_device(device), concurrent.futures.ThreadPoolExecutor(1) as pool:
    given = pool.submit(threaded_call, seen, device=device).result()
    plain = pool.submit(threaded_call, seen).result()
  assert list(given) == [str(device), "float64"]
  assert list(plain) == ["None", "float64"]


_EMITTER_CHECK = """
import json
import jaxacct
out = []
for steps in (1000, 10_000):  # (one program; the band's)
  r = jaxacct.dpsgd_epsilon(1.0, 0.01, steps, 1e-5)
  out.append([float(r.lower), float(r.estimate), float(r.upper)])
r = jaxacct.dpsgd_delta(0.8, 0.05, 300, 2.0)
out.append([float(r.lower), float(r.estimate), float(r.upper)])
print(json.dumps(out))
"""


def test_the_two_cpu_emitters_answer_alike(capsys):
  """XLA's CPU kernels come from its fusion emitters by default, from its elemental emitters in
  the command line's processes (``jaxacct.cli.quick_compile_flags``) and in the suite's
  (conftest). The same bounds from a process with the other choice than this one's, to 1e-10
  relative (the two round differently, ~1e-13 on epsilon): what the suite checks of the bounds
  holds for both builds."""
  import json
  import os
  import subprocess
  import sys
  from jaxacct.cli import quick_compile_flags
  here = os.environ.get("XLA_FLAGS", "")
  kept = " ".join(f for f in here.split() if "xla_cpu_use_fusion_emitters" not in f)
  other = kept if "xla_cpu_use_fusion_emitters=false" in here else quick_compile_flags(kept)
  assert other != here
  done = subprocess.run([sys.executable, "-c", _EMITTER_CHECK], capture_output=True, text=True,
                        env=dict(os.environ, XLA_FLAGS=other), timeout=600)
  assert done.returncode == 0, done.stderr[-2000:]
  exec(_EMITTER_CHECK, {})  # (the same answers in this process)
  this = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  np.testing.assert_allclose(json.loads(done.stdout.strip().splitlines()[-1]), this,
                             rtol=1e-10, atol=0.0)
