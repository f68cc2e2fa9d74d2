"""The composed privacy-loss distribution: compose once, query many times, append steps."""

from __future__ import annotations

import dataclasses

import jax

from jaxacct._inputs import check_delta, check_epsilon
from jaxacct._numerics import as_leaf, fast_jit, float64, scoped_gradients
from jaxacct.composition import checked
from jaxacct.pld import query, spectrum
from jaxacct.pld.plan import Plan
from jaxacct.results import Bounds


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrivacyLossDistribution:
  """A composed PLD for each adjacency direction (leading axis), ready for many queries.

  Compose once, then ask ``epsilon(delta)`` and ``delta(epsilon)`` as often as needed, and
  ``append`` further steps as training goes on. All fields are arrays (a pytree).
  """

  pmf: jax.Array | None    # [D, N] composed masses at (start + i) h (None: kept as ``band``)
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
  high_log: jax.Array      # [D] sum of count * log max_{k >= band} |F_k| (spectrum._high_band)
  mass_error: jax.Array    # [D] relative round-off of the total mass (scales delta)
  base: jax.Array          # [D] int64 grid index of position 0 of the circular result
  cgf: jax.Array           # [D, 2, K] log-MGF of the discrete sum at +-tilts
  log_finite: jax.Array    # [D] log P(sum finite)
  tail: jax.Array          # [D] sum of per-step truncated tail masses
  moved: jax.Array         # [D] expected number of round-off guard moves (Poisson mean)
  bias: jax.Array          # [D] total upward bias of the split (the estimate removes it)
  total_count: jax.Array   # [D] number of composed steps
  loss_top: jax.Array      # [D] no finite composed loss exceeds it (+inf: unbounded)
  plan: Plan
  # [D, band] complex: the pmf as p_j = Re sum_k band_k e^{2 pi i j k/N} when the spectrum above
  # the band is negligible (spectrum.band_fields_from_terms): queries in O(band) per evaluation.
  band: jax.Array | None = None

  @float64
  def epsilon(self, delta) -> Bounds:
    """Certified epsilon(delta), worst direction. ``delta`` may be an array (vectorised)."""
    delta = as_leaf(delta)
    check_delta(delta)
    return _epsilon_jit(self, delta)

  @float64
  def delta(self, epsilon) -> Bounds:
    """Certified delta(epsilon), worst direction. ``epsilon`` may be an array."""
    epsilon = as_leaf(epsilon)
    check_epsilon(epsilon)
    return _delta_jit(self, epsilon)

  @float64
  def append(self, composition) -> "PrivacyLossDistribution":
    """The PLD after further steps, on the same plan (no recomposition of earlier steps)."""
    composition = checked(composition, integer_counts=True)
    if self.pmf is None:
      raise ValueError("a PLD kept as its band cannot be appended to; compose it in full")
    return _append_jit(self, composition)

def compose(composition, plan: Plan) -> PrivacyLossDistribution:
  """Composed PLD of one setting of ``composition`` for each adjacency direction (pure;
  jit/vmap-able)."""
  return PrivacyLossDistribution(plan=plan, **spectrum.compose_fields(composition, plan))


def compose_band(composition, plan: Plan) -> PrivacyLossDistribution:
  """``compose`` kept as its band (``spectrum.compose_band_fields``: queries in O(band), no
  inverse transform; tight only where ``spectrum.high_band_negligible``, always certified)."""
  return PrivacyLossDistribution(plan=plan, **spectrum.compose_band_fields(composition, plan))


def append(pld: PrivacyLossDistribution, composition) -> PrivacyLossDistribution:
  """``pld`` followed by ``composition`` (pure): spectra multiply, running sums add."""
  previous = {key: getattr(pld, key) for key in ("spectrum", "low_ok") + spectrum.RUNNING_SUMS}
  return PrivacyLossDistribution(plan=pld.plan,
                                 **spectrum.append_fields(previous, composition, pld.plan))


_epsilon_jit = fast_jit(scoped_gradients(query.epsilon_from_pld))
_delta_jit = fast_jit(scoped_gradients(query.delta_from_pld))
_append_jit = fast_jit(scoped_gradients(append))
