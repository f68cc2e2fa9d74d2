"""Privacy-loss models: one dominating pair (P, Q) per mechanism and adjacency direction.

Conventions: the privacy loss is L = log(dP/dQ)(x) with x ~ P, and
delta(eps) = E_P[(1 - e^{eps - L})_+] + P(L = +inf). For a base mechanism the "remove" pair is
P = output with the user, Q = output without; Poisson subsampling at rate q gives
remove: P = q B1 + (1-q) B0, Q = B0 and add: P = B0, Q = q B1 + (1-q) B0.

Every model is a pytree whose leaves are float64 arrays (sigma, rate, ...), so one compiled
accountant serves any parameter values and ``vmap``/``grad`` work over them. A model answers, for
a direction flag ``add`` (False/0: the remove pair, True/1: the add pair; it may be traced, so
both directions share one compiled program):

* ``cdf_sf(loss)``: P(L <= l), P(L > l), Q(L <= l), Q(L > l), infinite atoms included. Both
  complementary values are computed directly so that tails keep full relative precision.
* ``inf_mass()``: P(L = +inf).
* ``max_loss()``: the largest finite value of L under P (its essential supremum), rounded up,
  +inf where L is unbounded. The composed finite loss is at most the steps' sum, so from there
  on delta is exactly P(L = +inf): the PLD accountant's delta is exact at and beyond a pure-DP
  mechanism's boundary (``jaxacct.pld.query``). It must never be below the true supremum.
* ``loss_range(log_tail)``: an interval holding all but exp(log_tail) of the finite loss mass
  under P and under Q (used to place grids, never to certify).
* ``loss_nodes(t, t_high=None, panels=None)``: (log weights under P, loss values), a quadrature
  of the finite part of L's law that is accurate for integrands concentrated where e^{sL} dP is,
  for every tilt s in [t, t_high] (default t_high = t; ``panels`` is the static size of the
  composite Gauss-Legendre rule). The cumulant generating function and its derivatives are read
  from it, see ``jaxacct.cgf``.

Models whose pair is the same in both directions set ``symmetric = True``. Models whose
``cdf_sf`` and ``loss_range`` are elementwise in their parameters and arguments (numpy
broadcasting, no reductions or control flow on values) set ``elementwise = True``: the planner
then evaluates a batch of settings in one call instead of one setting at a time.

``cdf_sf`` and ``loss_range`` are called one setting at a time (scalar parameters, a 1-D array of
losses) in JAX by the accountants, and with numpy values by the planner on the host: one setting
at a time too, or a block of settings at once where the model ``broadcasts`` (parameters
[settings, 1] against losses [settings, points]). The models here take numpy or jax.numpy from
their inputs (``array_namespace``), so planning compiles nothing; a model written with jax.numpy
alone also works (the planner then runs it eagerly).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxacct._inputs import check_range, check_whole
from jaxacct._numerics import (F64_EPS, LOSS_BIG, array_namespace, as_leaf, composite_nodes,
                               erfc, is_traced, sigmoid, standard_normal_nodes)
from jaxacct._solver import bisect

# Quadratures reach this many standard deviations beyond every bulk or tilted peak (the
# standard-normal mass beyond is below 1e-57 relative).
_REACH = 16.0
_SQRT_HALF = float(np.sqrt(0.5))

def _model(cls):
  """A frozen dataclass registered as a pytree whose fields are all data (array) fields.

  JAX rebuilds a model from its leaves without calling the constructor, so construction-time
  checks see only what a user passes, never a tracer-free placeholder of JAX's."""
  cls = dataclasses.dataclass(frozen=True)(cls)
  names = tuple(field.name for field in dataclasses.fields(cls))

  def flatten_with_keys(model):
    return [(jax.tree_util.GetAttrKey(name), getattr(model, name)) for name in names], None

  def unflatten(_, children):
    model = object.__new__(cls)
    for name, child in zip(names, children):
      object.__setattr__(model, name, child)
    return model

  jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten)
  return cls


def _is_parameter(value):
  """A value the constructor converts and checks: numbers, host arrays, concrete JAX arrays."""
  if isinstance(value, (list, tuple)):
    return all(_is_parameter(v) for v in value)
  return (isinstance(value, (int, float, np.ndarray, np.generic))
          or (isinstance(value, jax.Array) and not is_traced(value)))


def _normal_cdf_sf(*zs):
  """Phi(z) and Phi(-z) for each argument, from one ``erfc`` call on the small tails only.

  Returns [cdf_1, sf_1, cdf_2, sf_2, ...]. The smaller of the two is Phi(-|z|), accurate to its
  last digits in the far tail; the larger is its complement (>= 1/2, so 1 - tail loses nothing).
  """
  xp = array_namespace(*zs)
  return _stacked_normal_cdf_sf(xp.stack(xp.broadcast_arrays(*zs)))


def _stacked_normal_cdf_sf(z):
  """``_normal_cdf_sf`` of each row of ``z`` (leading axis: the arguments)."""
  xp = array_namespace(z)
  # Phi(-|z|) = erfc(|z| / sqrt 2) / 2: one erfc (``ndtr`` evaluates both erf and erfc and
  # selects: twice the compiled code). |z| has the right derivative at z = 0.
  tail = 0.5 * erfc(xp.where(z < 0.0, -z, z) * _SQRT_HALF)
  cdf = xp.where(z < 0.0, tail, 1.0 - tail)
  sf = xp.where(z < 0.0, 1.0 - tail, tail)
  return [v for i in range(z.shape[0]) for v in (cdf[i], sf[i])]


def _clamp(loss):
  return array_namespace(loss).clip(loss, -LOSS_BIG, LOSS_BIG)


def _rounded_up(value, ulps, scale=0.0):
  """``value`` raised by ``ulps`` ulps of |value| + ``scale``: above the exact result of a
  computation whose round-off is within that (a ``max_loss`` must not fall below the truth)."""
  return value + ulps * F64_EPS * (jnp.abs(value) + scale)


class PrivacyLoss:
  """Interface every mechanism implements (see the module docstring).

  Constructing a model converts list or tuple parameters to arrays (a batch) and checks concrete
  parameters (``ValueError`` naming the parameter); traced parameters pass unchecked.
  """

  symmetric: ClassVar[bool] = True
  elementwise: ClassVar[bool] = False

  def __post_init__(self):
    values = {}
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if isinstance(value, PrivacyLoss):
        continue
      if isinstance(value, (list, tuple)) and _is_parameter(value):
        object.__setattr__(self, field.name, as_leaf(value))
      values[field.name] = getattr(self, field.name)
    if all(_is_parameter(v) or is_traced(v) for v in values.values()):
      self.check()

  def _xp(self, *values):
    """The array namespace of this model's parameters and ``values`` (see array_namespace)."""
    return array_namespace(self, *values)

  def broadcasts(self) -> bool:
    """Whether ``cdf_sf`` and ``loss_range`` broadcast over a batch of settings (``elementwise``,
    and so every model inside it)."""
    return type(self).elementwise

  def cdf_sf(self, loss, add=False):
    raise NotImplementedError

  def inf_mass(self, add=False):
    return jnp.zeros(())

  def max_loss(self, add=False):
    """Upper bound of the largest finite loss (see the module docstring); unbounded here."""
    return jnp.asarray(jnp.inf)

  def has_atoms(self) -> bool:
    """Whether the loss has point masses at finite values (a grid's error is then first order
    in its step near them, not second order: the planner refines the grid)."""
    return False

  def loss_range(self, log_tail, add=False):
    raise NotImplementedError

  def loss_nodes(self, t, add=False, t_high=None, panels=None):
    raise ValueError(f"{type(self).__name__} has no cumulant generating function")

  def base_nodes(self, t, add=False, t_high=None, panels=None, rate=1.0):
    """Nodes of this model's (remove-direction) loss Z under P, as the base of a step Poisson-
    subsampled at ``rate`` and tilted by t (up to t_high): they must cover P's bulk, Q's bulk
    (dQ = e^{-Z} dP) and where the subsampled direction's tilted integrand peaks."""
    return self.loss_nodes(t, t_high=t_high, panels=panels)

  def check(self):
    """Raises ValueError on invalid concrete parameters (no-op under tracing)."""


@_model
class Gaussian(PrivacyLoss):
  """Gaussian mechanism N(f(D), sigma^2) with L2 sensitivity ``sensitivity``.

  L ~ N(mu^2/2, mu^2) under P and N(-mu^2/2, mu^2) under Q, mu = sensitivity / sigma.
  """

  elementwise: ClassVar[bool] = True

  sigma: jax.Array
  sensitivity: jax.Array = 1.0

  def check(self):
    check_range("sigma", self.sigma, 0.0, math.inf)
    check_range("sensitivity", self.sensitivity, 0.0, math.inf)

  def _mu(self):
    return self.sensitivity / self.sigma

  def cdf_sf(self, loss, add=False):
    mu = self._mu()
    loss = _clamp(loss)
    half = 0.5 * mu * mu
    signs = np.reshape([-1.0, 1.0], (2,) + (1,) * max(np.ndim(loss), np.ndim(half)))
    return tuple(_stacked_normal_cdf_sf((loss + signs * half) / mu))

  def loss_range(self, log_tail, add=False):
    mu = self._mu()
    z = self._xp(log_tail).sqrt(-2.0 * log_tail)
    return -0.5 * mu * mu - z * mu, 0.5 * mu * mu + z * mu

  def loss_nodes(self, t, add=False, t_high=None, panels=None):
    return self.base_nodes(t, t_high=t_high, panels=panels)

  def base_nodes(self, t, add=False, t_high=None, panels=None, rate=1.0):
    # Z = mu u + mu^2/2 with u ~ N(0, 1) under P; Q's bulk is at u = -mu. Subsampled, the remove
    # integrand's stationary points lie in [-mu, t mu]; the add one, e^{-t f(Z)} dQ, is
    # log-concave with its mode left of -mu (``_add_mode``), furthest left at t_high.
    mu = self._mu()
    t_high = t if t_high is None else t_high
    left = jnp.where(add, _add_mode(mu, jnp.maximum(t_high, 0.0), rate), t * mu)
    right = jnp.where(add, 0.0, t_high * mu)
    log_w, u = standard_normal_nodes(jnp.minimum(-mu, left) - _REACH,
                                     jnp.maximum(0.0, right) + _REACH, panels)
    return log_w, mu * u + 0.5 * mu * mu


def _add_mode(mu, t, rate, steps=30):
  """Mode in u of the add-direction integrand of a subsampled Gaussian tilted by t,
  phi(u) e^{-Z - t f(Z)} with Z = mu u + mu^2/2: the root of u + mu (1 + t f'(Z)) = 0, where
  f'(Z) = sigmoid(Z + logit q) rises to 1, so it lies in [-(1 + t) mu, -mu] (at -(1 + t) mu for
  q = 1). Bisection: the left side is increasing in u. Only places nodes (no gradient)."""
  mu, t, rate = (jax.lax.stop_gradient(jnp.asarray(v, jnp.float64)) for v in (mu, t, rate))
  logit = jnp.log(rate) - _log1m_rate(rate)
  side = lambda u: u + mu * (1.0 + t * jax.nn.sigmoid(mu * u + 0.5 * mu * mu + logit))

  return bisect(side, -(1.0 + t) * mu, -mu, steps)[0]


@_model
class Laplace(PrivacyLoss):
  """Laplace mechanism f(D) + Lap(scale) with L1 sensitivity ``sensitivity``.

  With e0 = sensitivity / scale, L has atoms at +-e0 and a continuous part in between:
  P(L <= l) = exp((l - e0)/2)/2 and Q(L > l) = exp(-(l + e0)/2)/2 for -e0 <= l < e0.
  """

  elementwise: ClassVar[bool] = True

  scale: jax.Array
  sensitivity: jax.Array = 1.0

  def check(self):
    check_range("scale", self.scale, 0.0, math.inf)
    check_range("sensitivity", self.sensitivity, 0.0, math.inf)

  def cdf_sf(self, loss, add=False):
    xp = self._xp(loss)
    e0 = self.sensitivity / self.scale
    lc = xp.clip(loss, -e0, e0)
    below, above = loss < -e0, loss >= e0
    p_small = 0.5 * xp.exp(0.5 * (lc - e0))
    q_small = 0.5 * xp.exp(-0.5 * (lc + e0))
    p_cdf = xp.where(below, 0.0, xp.where(above, 1.0, p_small))
    p_sf = xp.where(below, 1.0, xp.where(above, 0.0, 1.0 - p_small))
    q_sf = xp.where(below, 1.0, xp.where(above, 0.0, q_small))
    q_cdf = xp.where(below, 0.0, xp.where(above, 1.0, 1.0 - q_small))
    return p_cdf, p_sf, q_cdf, q_sf

  def loss_range(self, log_tail, add=False):
    e0 = self.sensitivity / self.scale
    return -e0, e0

  def max_loss(self, add=False):
    return _rounded_up(jnp.asarray(self.sensitivity / self.scale, jnp.float64), 2.0)

  def has_atoms(self) -> bool:
    return True

  def loss_nodes(self, t, add=False, t_high=None, panels=None):
    # Atoms at e0 (P-mass 1/2) and -e0 (e^{-e0}/2); density e^{(l - e0)/2}/4 in between
    # (analytic, so Gauss-Legendre is exact to rounding). Valid for every tilt.
    e0 = self.sensitivity / self.scale
    x, w = composite_nodes(-e0, e0, panels)
    log_w = jnp.log(w) + 0.5 * (x - e0) - np.log(4.0)
    return (jnp.concatenate([log_w, jnp.stack([-np.log(2.0), -e0 - np.log(2.0)])]),
            jnp.concatenate([x, jnp.stack([e0, -e0])]))


@_model
class EpsilonDelta(PrivacyLoss):
  """The canonical (epsilon, delta)-DP pair (randomized response with a delta "leak").

  P puts delta on L = +inf and (1-delta) on L = +-epsilon in proportion e^eps : 1; Q is its mirror
  (delta on L = -inf). With ``delta = 0`` this is pure epsilon-DP, i.e. binary randomized response
  with P(truth) = e^eps / (1 + e^eps), the worst case for any epsilon-DP mechanism.
  """

  epsilon: jax.Array
  delta: jax.Array = 0.0

  def check(self):
    check_range("epsilon", self.epsilon, 0.0, math.inf, low_open=False)
    check_range("delta", self.delta, 0.0, 1.0, low_open=False)

  def cdf_sf(self, loss, add=False):
    eps, dlt = self.epsilon, self.delta
    hi = (1.0 - dlt) * sigmoid(eps)   # P(L = +eps) = Q(L = -eps)
    lo = (1.0 - dlt) * sigmoid(-eps)  # P(L = -eps) = Q(L = +eps)
    ge_lo = (loss >= -eps).astype(loss.dtype)
    ge_hi = (loss >= eps).astype(loss.dtype)
    p_cdf = ge_lo * lo + ge_hi * hi
    p_sf = dlt + (1.0 - ge_hi) * hi + (1.0 - ge_lo) * lo
    q_cdf = dlt + ge_lo * hi + ge_hi * lo
    q_sf = (1.0 - ge_hi) * lo + (1.0 - ge_lo) * hi
    return p_cdf, p_sf, q_cdf, q_sf

  def inf_mass(self, add=False):
    return jnp.asarray(self.delta, dtype=jnp.result_type(float))

  def max_loss(self, add=False):
    return jnp.asarray(self.epsilon, jnp.float64)  # (the atom is at epsilon itself)

  def has_atoms(self) -> bool:
    return True

  def loss_range(self, log_tail, add=False):
    return -self.epsilon, self.epsilon

  def loss_nodes(self, t, add=False, t_high=None, panels=None):
    # The finite part only; the delta atom at +inf makes K infinite (see jaxacct.cgf).
    eps = self.epsilon
    log_finite = jnp.log1p(-self.delta)
    return (jnp.stack([jax.nn.log_sigmoid(eps), jax.nn.log_sigmoid(-eps)]) + log_finite,
            jnp.stack([eps, -eps]))


def PureDP(epsilon):  # noqa: N802 - a constructor that reads like a class
  """Pure epsilon-DP (binary randomized response): ``EpsilonDelta(epsilon, 0)``."""
  return EpsilonDelta(epsilon, 0.0)


@_model
class RandomizedResponse(PrivacyLoss):
  """k-ary randomized response under replace-one adjacency, as dp-accounting defines it: the
  input bucket is output with probability 1 - p, else a bucket drawn uniformly from all k
  (``noise`` p in (0, 1], ``buckets`` k >= 2 whole).

  For inputs x != x' the loss is +e0 at the output x (P-probability 1 - p + p/k), -e0 at x'
  (p/k) and 0 at the k - 2 others ((k - 2) p/k), e0 = log(1 + k (1 - p)/p); Q is the mirror.
  With k = 2 it is binary randomized response, ``EpsilonDelta(e0)``; p = 1 releases nothing.
  """

  noise: jax.Array
  buckets: jax.Array

  def check(self):
    check_range("noise", self.noise, 0.0, 1.0, high_open=False)
    check_range("buckets", self.buckets, 2.0, math.inf, low_open=False)
    check_whole("buckets", self.buckets)

  def _atoms(self, xp):
    """e0 and the P-masses at +e0, 0 and -e0."""
    p, k = self.noise, self.buckets
    e0 = xp.log1p(k * (1.0 - p) / p)
    return e0, 1.0 - p + p / k, (k - 2.0) * p / k, p / k

  def cdf_sf(self, loss, add=False):
    xp = self._xp(loss)
    e0, hi, mid, lo = self._atoms(xp)
    ge = [(loss >= at).astype(loss.dtype) for at in (-e0, 0.0 * e0, e0)]
    masses_p, masses_q = (lo, mid, hi), (hi, mid, lo)  # at -e0, 0, +e0
    p_cdf = sum(g * m for g, m in zip(ge, masses_p))
    p_sf = sum((1.0 - g) * m for g, m in zip(ge, masses_p))
    q_cdf = sum(g * m for g, m in zip(ge, masses_q))
    q_sf = sum((1.0 - g) * m for g, m in zip(ge, masses_q))
    return p_cdf, p_sf, q_cdf, q_sf

  def has_atoms(self) -> bool:
    return True

  def max_loss(self, add=False):
    return _rounded_up(self._atoms(jnp)[0], 8.0)

  def loss_range(self, log_tail, add=False):
    e0 = self._atoms(self._xp(log_tail))[0]
    return -e0, e0

  def loss_nodes(self, t, add=False, t_high=None, panels=None):
    e0, hi, mid, lo = self._atoms(jnp)
    present = mid > 0.0  # (no middle atom for k = 2: log 0 with a finite gradient)
    log_mid = jnp.where(present, jnp.log(jnp.where(present, mid, 1.0)), -jnp.inf)
    return jnp.stack([jnp.log(hi), log_mid, jnp.log(lo)]), jnp.stack([e0, 0.0 * e0, -e0])


def subsampled_loss(base_loss, rate):
  """f(z) = log(1 - q + q e^z): the remove-direction loss of a Poisson-subsampled step.

  One log1p of a branch-selected argument (three transcendentals per value: this runs on every
  quadrature node): z + log q + log1p((1-q)/q e^{-z}) for z > 0 (and at q = 1, where f(z) = z);
  log1p(q expm1(z)), accurate while q (e^z - 1) stays away from -1; beyond (q near 1, z << 0)
  log(1 - q) + log1p(q e^z / (1 - q)).
  """
  z = base_loss
  xp = array_namespace(z, rate)
  full = rate >= 1.0
  q_below_one = xp.where(full, 0.5, rate)
  decay = xp.exp(-xp.clip(z, -700.0, 700.0))  # e^{-z}; its inverse is e^z for z <= 0
  rise = xp.expm1(xp.where(z > 0.0, 0.0, z))
  pos = (z > 0.0) | full
  near = ~pos & (rate * rise > -0.5)
  far = ~pos & ~near
  # Each branch sees a harmless placeholder where it is not selected (finite values and
  # gradients: e^{700} times a large ratio would overflow).
  arg = xp.where(pos, (1.0 - rate) / rate * xp.where(pos, decay, 0.0),
                 xp.where(near, rate * rise,
                          q_below_one / (1.0 - q_below_one) / xp.where(far, decay, 1.0)))
  offset = xp.where(pos, z + xp.log(rate), xp.where(near, 0.0, _log1m_rate(rate)))
  return offset + xp.log1p(arg)


def _subsampled_top(z, rate, down=False):
  """f(z) = ``subsampled_loss(z, rate)`` for z in [-inf, +inf], rounded up (``down``: rounded
  down) by its round-off: a few ulps of each term of the branch that computes it."""
  finite = jnp.isfinite(z)
  safe = jnp.where(finite, z, 0.0)
  value = subsampled_loss(safe, rate)
  value = jnp.where(finite, value, jnp.where(z > 0.0, jnp.inf, _log1m_rate(rate)))
  logs = jnp.abs(jnp.log(rate)) + jnp.where(rate < 1.0, jnp.abs(_log1m_rate(rate)), 0.0)
  slack = 4.0 * F64_EPS * (1.0 + jnp.abs(safe) + logs + jnp.where(finite, jnp.abs(value), 0.0))
  return jnp.where(jnp.isfinite(value), value + (-slack if down else slack), value)


def _log1m_rate(rate):
  """log(1 - q), -inf at q = 1, with finite gradients everywhere."""
  xp = array_namespace(rate)
  below_one = rate < 1.0
  return xp.where(below_one, xp.log1p(-xp.where(below_one, rate, 0.5)), -xp.inf)


def _base_loss_of(loss, rate):
  """z(l) = log((e^l - 1 + q)/q), the inverse of ``_subsampled_loss``, and the support mask.

  Off the support (l <= log(1 - q)) z is -LOSS_BIG, where every base CDF is its -inf atom.
  """
  xp = array_namespace(loss, rate)
  support = loss > _log1m_rate(rate)
  shifted = xp.where(support, xp.expm1(xp.minimum(loss, 700.0)) + rate, 1.0)
  z = xp.where(support, xp.log(shifted) - xp.log(rate), -LOSS_BIG)
  return xp.clip(z, -LOSS_BIG, LOSS_BIG), support


@_model
class PoissonSampled(PrivacyLoss):
  """Poisson subsampling at ``rate`` of any base model (DP-SGD's sampling).

  The two adjacency directions are different pairs; accountants compose each and report the worse.
  """

  base: PrivacyLoss
  rate: jax.Array

  symmetric: ClassVar[bool] = False

  def broadcasts(self) -> bool:
    return self.base.broadcasts()

  def check(self):
    self.base.check()
    check_range("rate", self.rate, 0.0, 1.0, high_open=False)

  def cdf_sf(self, loss, add=False):
    q, xp = self.rate, self._xp(loss, add)
    # remove: L = f(L_base) under P = mixture, Q = B0; add: L = -f(L_base) under P = B0,
    # Q = mixture, so L <= l  <=>  L_base >= z(-l) and the roles of CDF and SF swap.
    z, support = _base_loss_of(xp.where(add, -1.0, 1.0) * _clamp(loss), q)
    bp_cdf, bp_sf, bq_cdf, bq_sf = self.base.cdf_sf(z)
    mix_cdf = q * bp_cdf + (1.0 - q) * bq_cdf
    mix_sf = q * bp_sf + (1.0 - q) * bq_sf
    on = lambda value, off: xp.where(support, value, off)
    remove = (on(mix_cdf, 0.0), on(mix_sf, 1.0), on(bq_cdf, 0.0), on(bq_sf, 1.0))
    # With q = 1 the base's -inf atom under Q is P(L = +inf) in the add pair; p_sf includes it.
    added = (on(bq_sf, 1.0), on(bq_cdf, 0.0), on(mix_sf, 1.0), on(mix_cdf, 0.0))
    return tuple(xp.where(add, a, r) for r, a in zip(remove, added))

  def has_atoms(self) -> bool:
    return self.base.has_atoms()

  def max_loss(self, add=False):
    # remove: L = f(Z), f increasing, so its top is f(the base's top). add: L = -f(Z) under B0,
    # whose least Z is -(the base's add-direction top), or -inf where B0 has mass off B1's
    # support (the base's atom at +inf in its add pair): there L = -log(1 - q) (+inf at q = 1,
    # an infinite atom, not a finite loss).
    q = self.rate
    low = -self.base.max_loss(True)
    off_support = (self.base.inf_mass(True) > 0.0) & (q < 1.0)
    remove = _subsampled_top(self.base.max_loss(), q)
    added = -_subsampled_top(jnp.where(off_support, -jnp.inf, low), q, down=True)
    return jnp.where(add, added, remove)

  def inf_mass(self, add=False):
    q = self.rate
    # add (q = 1 only): the base's atom at -inf under Q, which for a symmetric base is its atom
    # at +inf under P (no special function is evaluated: compiled code saved where it is 0).
    bq_atom = (self.base.inf_mass() if self.base.symmetric
               else self.base.cdf_sf(jnp.asarray(-LOSS_BIG))[2])
    return jnp.where(add, jnp.where(q >= 1.0, bq_atom, 0.0), q * self.base.inf_mass())

  def loss_range(self, log_tail, add=False):
    q, xp = self.rate, self._xp(log_tail, add)
    lo_b, hi_b = self.base.loss_range(log_tail)
    lo = xp.where(q < 1.0, _log1m_rate(q), lo_b)
    hi = subsampled_loss(hi_b, q)
    return xp.where(add, -hi, lo), xp.where(add, -lo, hi)

  def loss_nodes(self, t, add=False, t_high=None, panels=None):
    # remove: L = f(Z) under q B1 + (1-q) B0 = e^{f(Z) - Z} dB1; add: L = -f(Z) under
    # B0 = e^{-Z} dB1. For large Z the remove integrand grows like e^{t Z} dB1; the add one decays.
    log_w, z = self.base.base_nodes(t, add, t_high, panels, rate=self.rate)
    f = subsampled_loss(z, self.rate)
    return log_w - z + jnp.where(add, 0.0, f), jnp.where(add, -f, f)


@_model
class SampledGaussianReplaceOne(PrivacyLoss):
  """Poisson-subsampled Gaussian under replace-one adjacency, as dp-accounting defines it.

  P = q N(-s, sigma^2) + (1-q) N(0, sigma^2) and Q = q N(s, sigma^2) + (1-q) N(0, sigma^2); the
  pair is its own mirror image, so one direction suffices. With q = 1 it is the Gaussian mechanism
  with sensitivity 2s. The loss is decreasing in x and its inverse solves a quadratic:
  a x = -asinh(B / C) - l/2 with a = s/sigma^2, B = (1-q) sinh(l/2), C = q exp(-s^2/(2 sigma^2)).
  """

  elementwise: ClassVar[bool] = True

  sigma: jax.Array
  rate: jax.Array
  sensitivity: jax.Array = 1.0

  def check(self):
    check_range("sigma", self.sigma, 0.0, math.inf)
    check_range("rate", self.rate, 0.0, 1.0, high_open=False)
    check_range("sensitivity", self.sensitivity, 0.0, math.inf)

  def _x_of_loss(self, loss):
    s, sig, q = self.sensitivity, self.sigma, self.rate
    xp = self._xp(loss)
    a = s / sig**2
    c = 0.5 * (s / sig) ** 2
    half = 0.5 * xp.clip(loss, -1400.0, 1400.0)
    nonzero = (half != 0.0) & (q < 1.0)
    abs_half = xp.where(nonzero, xp.abs(half), 1.0)
    log_sinh = xp.where(abs_half > 1.0,
                        abs_half + xp.log1p(-xp.exp(-2.0 * abs_half)) - xp.log(2.0),
                        xp.log(xp.sinh(abs_half)))
    q_safe = xp.where(q < 1.0, q, 0.5)
    log_ratio = xp.log1p(-q_safe) + log_sinh + c - xp.log(q_safe)  # log |B / C|
    big = log_ratio > 30.0
    asinh_abs = xp.where(big, log_ratio + xp.log(2.0),
                         xp.arcsinh(xp.exp(xp.minimum(log_ratio, 30.0))))
    log_v = xp.where(nonzero, -xp.sign(half) * asinh_abs, 0.0)
    return (log_v - half) / a

  def cdf_sf(self, loss, add=False):
    s, sig, q = self.sensitivity, self.sigma, self.rate
    x = self._x_of_loss(_clamp(loss))  # L <= l  <=>  X >= x
    # P(L <= l) = P(X >= x): each component's upper tail is the loss CDF, its lower tail the SF.
    up_sf, up_cdf, mid_sf, mid_cdf, dn_sf, dn_cdf = _normal_cdf_sf(
        (x + s) / sig, x / sig, (x - s) / sig)
    p_cdf = q * up_cdf + (1.0 - q) * mid_cdf
    p_sf = q * up_sf + (1.0 - q) * mid_sf
    q_cdf = q * dn_cdf + (1.0 - q) * mid_cdf
    q_sf = q * dn_sf + (1.0 - q) * mid_sf
    return p_cdf, p_sf, q_cdf, q_sf

  def loss_range(self, log_tail, add=False):
    s, sig, q = self.sensitivity, self.sigma, self.rate
    xp = self._xp(log_tail)
    z = xp.sqrt(-2.0 * log_tail)
    a = s / sig**2
    c = 0.5 * (s / sig) ** 2
    log1mq = _log1m_rate(q)

    def loss_at(x):
      num = xp.logaddexp(xp.log(q) - a * x - c, log1mq)
      den = xp.logaddexp(xp.log(q) + a * x - c, log1mq)
      return num - den

    x_edge = s + z * sig
    return loss_at(x_edge), loss_at(-x_edge)

  def loss_nodes(self, t, add=False, t_high=None, panels=None):
    # In u = x / sigma: log densities of the two mixtures; P^{1+t} Q^{-t} peaks near u = -(1+t) mu.
    mu = self.sensitivity / self.sigma
    q = self.rate
    log1mq = _log1m_rate(q)
    t_high = t if t_high is None else t_high
    log_w, u = standard_normal_nodes(-(1.0 + t_high) * mu - _REACH, mu + _REACH, panels)
    log_p = jnp.logaddexp(jnp.log(q) - mu * u - 0.5 * mu * mu, log1mq)  # relative to N(0, 1)
    log_q = jnp.logaddexp(jnp.log(q) + mu * u - 0.5 * mu * mu, log1mq)
    return log_w + log_p, log_p - log_q
