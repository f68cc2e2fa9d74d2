"""Cumulant generating function K(t) = log E_P[e^{tL}] of a step's privacy loss, and its cumulants.

What the constant-time accountants (saddle point, Edgeworth, Renyi DP) read from a privacy-loss
model. ``cumulants(model, t, add)`` returns, per step,

    (K, K', K'', K''', K'''', rho)(t),   rho(t) = E|L_t - K'(t)|^3,

where L_t is the loss tilted by e^{tL} (its k-th cumulant is the k-th derivative of K at t).
Closed forms are used where they exist (Gaussian); otherwise the model's ``loss_nodes(t, add)``
(a quadrature of the loss law under P, accurate where e^{tL} dP is concentrated) gives them as the
moments of the tilted weights, which are exactly the derivatives of the discrete log-sum-exp.
A composition's cumulants are sum_i count_i x step_i (real counts allowed).

Models with an atom at L = +inf ((epsilon, delta)-DP with delta > 0) have K = +inf for t > 0 and
are refused by the CGF accountants (``check_cgf``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from jaxacct import _batch, models, results
from jaxacct._numerics import is_traced
from jaxacct.composition import Composition, counted_sum, kinds, over_kind, total_count
from jaxacct.composition import checked as checked_composition
from jaxacct.results import Bounds


_MOMENT_PANELS = 48


def _tilted(log_weights, losses, t):
  """(K, unnormalised tilted weights, their total, mean, deviations from it) of the discrete law
  sum_i w_i delta_{l_i} tilted by e^{tl}. Moments are sums over the unnormalised weights divided
  once by the total (no division per node)."""
  a = log_weights + t * losses
  top = jax.lax.stop_gradient(jnp.max(a))
  scaled = jnp.exp(a - top)  # the one exponential per node
  total = jnp.sum(scaled)
  mean = jnp.sum(scaled * losses) / total
  return top + jnp.log(total), scaled, total, mean, losses - mean


@jax.custom_jvp
def tilted_cumulants(log_weights, losses, t):
  """(K, K', K'', K''', K'''', rho) at tilt t of the discrete law sum_i w_i delta_{l_i}.

  Differentiated by a rule, not through every per-node operation: in t alone (each Newton step
  of the saddle-point accountant) the derivatives are higher moments of the same weights."""
  return _cumulants_of(*_tilted(log_weights, losses, t))


def _cumulants_of(k, scaled, total, mean, d):
  w2 = scaled * d * d
  m2, m3, m4, rho = (jnp.sum(w2 * f) / total for f in (1.0, d, d * d, jnp.abs(d)))
  return jnp.stack([k, mean, m2, m3, m4 - 3.0 * m2 * m2, rho])


@functools.partial(tilted_cumulants.defjvp, symbolic_zeros=True)
def _tilted_cumulants_jvp(primals, tangents):
  """With da = d(log w) + t dl + l dt and ea = da - E da: dE[g(l)] = E[ea g] + E[g' dl] (the
  centre of the central moments moves by dk1). In t alone ea = d dt, so dK_j/dt = K_{j+1}:
  dm_k/dt = m_{k+1} - k m_{k-1} m2 and d rho/dt = E[|d|^3 d] - 3 m2 E[d |d|]."""
  log_weights, losses, t = primals
  d_log_weights, d_losses, d_t = tangents
  k, scaled, total, mean, d = _tilted(log_weights, losses, t)
  out = _cumulants_of(k, scaled, total, mean, d)
  m2, m3 = out[2], out[3]
  moment = lambda f: jnp.sum(scaled * f) / total
  d2, abs_d = d * d, jnp.abs(d)
  is_zero = lambda x: isinstance(x, SymbolicZero)
  if is_zero(d_log_weights) and is_zero(d_losses):
    d_t = jnp.zeros_like(t) if is_zero(d_t) else d_t
    m5, abs3_d, abs_d_d = (moment(f) for f in (d2 * d2 * d, abs_d * d2 * d, abs_d * d))
    # (K, K', K'', K''') move by the next cumulant, read off ``out``; K'''' and rho need m5,
    # E|d|^3 d and E d|d|.
    rates = jnp.concatenate([out[1:5], jnp.stack([m5 - 10.0 * m3 * m2,
                                                  abs3_d - 3.0 * m2 * abs_d_d])])
    return out, rates * d_t
  dense = lambda x, like: jnp.zeros_like(like) if is_zero(x) else x
  d_losses = dense(d_losses, losses)
  da = dense(d_log_weights, log_weights) + t * d_losses + losses * dense(d_t, t)
  dk = moment(da)
  ea = da - dk
  dk1 = moment(ea * d) + moment(d_losses)
  central = lambda p, lower: moment(ea * d ** p) + p * (moment(d ** (p - 1) * d_losses)
                                                        - lower * dk1)
  dm2, dm3, dm4 = central(2, 0.0), central(3, m2), central(4, m3)
  drho = (moment(ea * abs_d * d2)
          + 3.0 * (moment(abs_d * d * d_losses) - moment(abs_d * d) * dk1))
  return out, jnp.stack([dk, dk1, dm2, dm3, dm4 - 6.0 * m2 * dm2, drho])


def _gaussian_cumulants(mu, t):
  """Closed form: L ~ N(mu^2/2, mu^2), K = mu^2 t (t + 1) / 2, rho = 2 sqrt(2/pi) mu^3."""
  mu2 = mu * mu
  zero = jnp.zeros_like(t * mu)
  return jnp.stack([0.5 * mu2 * t * (t + 1.0), mu2 * (t + 0.5) + zero, mu2 + zero, zero, zero,
                    2.0 * math.sqrt(2.0 / math.pi) * mu2 * mu + zero])


def tilted_moments(log_weights, losses, t):
  """(k1, k2, k3, k4, k5, E|d|, E|d|^3, E d^4) of the discrete law sum_i w_i delta_{l_i} tilted
  by e^{tl}: its first five cumulants and the absolute central moments (d = l - k1) that the
  Edgeworth error bounds read. Two-pass (central) moments keep tiny sampling rates exact."""
  _, scaled, total, mean, d = _tilted(log_weights, losses, t)
  moment = lambda f: jnp.sum(scaled * f) / total
  c2, c3, c4, c5 = (moment(d ** k) for k in (2, 3, 4, 5))
  return jnp.stack([mean, c2, c3, c4 - 3.0 * c2 * c2, c5 - 10.0 * c3 * c2,
                    moment(jnp.abs(d)), moment(jnp.abs(d) ** 3), c4])


def law_moments(model, t, add=False):
  """``tilted_moments`` of one step's loss under e^{tL} dP / E_P e^{tL}, for each tilt in the
  array ``t`` (within [-1, 0]; t = 0 is the law under P, t = -1 the law under Q), stacked along
  the last axis. Gaussian: closed form (L ~ N(mu^2 (t + 1/2), mu^2))."""
  t = jnp.asarray(t, jnp.float64)
  if isinstance(model, models.Gaussian):
    mu = model.sensitivity / model.sigma
    s = mu + jnp.zeros_like(t)
    zero = jnp.zeros_like(s)
    return jnp.stack([mu * mu * (t + 0.5), s * s, zero, zero, zero, math.sqrt(2.0 / math.pi) * s,
                      2.0 * math.sqrt(2.0 / math.pi) * s ** 3, 3.0 * s ** 4])
  # Every model's nodes at tilt 0 cover both P's and Q's bulk (see models.PrivacyLoss): one set
  # of nodes serves every tilt asked for. Untilted laws are smooth bulks, so a smaller rule
  # suffices (within 2e-10 relative of the full one, measured down to q = 1e-4, sigma = 0.3).
  nodes = model.loss_nodes(jnp.zeros(()), add, panels=_MOMENT_PANELS)
  out = jax.vmap(lambda tilt: tilted_moments(*nodes, tilt), out_axes=-1)(t.reshape(-1))
  out = out.reshape(out.shape[:1] + t.shape)
  return jnp.where(model.inf_mass(add) > 0.0, jnp.inf, out)


def step_cumulants(model, t, add=False, nodes=None):
  """(K, K', K'', K''', K'''', rho) of one step of ``model`` at tilt t, direction ``add``, from
  the model's nodes at t or from ``nodes`` (``tilt_nodes``: reusable across tilts)."""
  t = jnp.asarray(t, jnp.float64)
  if isinstance(model, models.Gaussian):
    return _gaussian_cumulants(model.sensitivity / model.sigma, t)
  out = tilted_cumulants(*(model.loss_nodes(t, add) if nodes is None else nodes), t)
  # Mass at L = +inf ((epsilon, delta)-DP): K = +inf for t > 0 (check_cgf refuses it).
  return jnp.where(model.inf_mass(add) > 0.0, jnp.inf, out)


def tilt_nodes(composition: Composition, t_low, t_high, add=False, panels=None):
  """Per kind of entry (``composition.kinds``), its entries' quadrature nodes valid for every
  tilt in [t_low, t_high], stacked (None where a closed form is used): computed once, they make
  each further ``cumulants`` call a cheap reweighting. ``panels`` (static) sets the rule's size;
  fewer panels give a cheaper, coarser K."""
  mechanisms = composition.mechanisms
  nodes = lambda mech: mech.loss_nodes(t_low, add, t_high=t_high, panels=panels)
  return tuple(None if isinstance(mechanisms[indices[0]], models.Gaussian)
               else over_kind(nodes, indices, mechanisms) for indices in kinds(mechanisms))


def cumulants(composition: Composition, t, add=False, nodes=None):
  """Sum over entries of count x step cumulants (real counts allowed); ``nodes`` from
  ``tilt_nodes`` (covering t) or None for each model's own nodes at t. The entries of one kind
  are one traced step, vmapped over them (``composition.counted_sum``)."""
  step = lambda mech, own=None: step_cumulants(mech, t, add, own)
  return counted_sum(step, composition, nodes)


def check_cgf(composition: Composition):
  """Raises ValueError for entries whose CGF is infinite (an atom at infinite loss, e.g.
  (epsilon, delta)-DP with delta > 0) or not modelled (concrete inputs)."""
  for mech in composition.mechanisms:
    inner = mech.base if isinstance(mech, models.PoissonSampled) else mech
    if type(inner).loss_nodes is models.PrivacyLoss.loss_nodes:
      raise ValueError(f"no cumulant generating function for {type(inner).__name__}: use the PLD "
                       "accountant (accountant='pld')")
    # A subsampled model has mass at infinite loss exactly where its base does (the bases with a
    # CGF are symmetric or have no infinite atoms); only a model that defines such mass is read.
    if is_traced(inner) or type(inner).inf_mass is models.PrivacyLoss.inf_mass:
      continue
    with jax.enable_x64(True):
      atom = np.asarray(inner.inf_mass())
    if np.any(atom > 0.0):
      raise ValueError(f"{type(inner).__name__} with mass at infinite privacy loss (e.g. "
                       "(epsilon, delta)-DP with delta > 0) has an infinite cumulant generating "
                       "function: use the PLD accountant (accountant='pld')")


def checked(composition) -> Composition:
  """The CGF accountants' input check: models' parameters, real counts >= 0, a finite CGF."""
  composition = checked_composition(composition, integer_counts=False)
  check_cgf(composition)
  return composition


def _worst_direction(composition: Composition, fn, arg, method):
  """``fn(composition, arg, method, add)`` for each adjacency direction (vmapped over the flag;
  one direction for a symmetric composition), the worse guarantee kept (``results.worst_over``).
  A composition of no steps is exactly 0 (no privacy loss)."""
  flags = jnp.array([0.0] if composition.symmetric else [0.0, 1.0])
  per_direction = jax.vmap(lambda add: fn(composition, arg, method, add))(flags)
  return results.zero_if(total_count(composition) == 0, results.worst_over(per_direction))


_CHUNK = 64  # settings per vmapped block of a CGF accountant's batch
_RUNNERS = {}


def query(fn, method, composition, x) -> Bounds:
  """A CGF accountant's answer over the broadcast batch of (composition, x): ``fn(composition,
  x, method, add)`` per setting and direction, the worse direction kept, compiled once per
  (fn, method) and block shape."""
  key = (fn, method)
  if key not in _RUNNERS:
    _RUNNERS[key] = _batch.blockwise(lambda comp, v: _worst_direction(comp, fn, v, method),
                                     _CHUNK)
  return _batch.answer(_RUNNERS[key], composition, x)
