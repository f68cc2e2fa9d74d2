"""Calibrating a training run for its own sampler and accountant.

``calibrate(config, target_epsilon)`` returns ``config`` with the smallest noise multiplier
(within 0.5 % of it) at which ``planned_epsilon`` -- what the run itself certifies: its sampler's
composition (Poisson, a fixed batch accounted at sensitivity 2, the full batch), a small
buffer's overflow allowance, a filter's per-example guarantee -- meets the target, never above
it. Calibrating a fixed-batch or filtered run as Poisson DP-SGD (``jaxacct.calibrate``) gives
about half the noise a fixed batch needs, or a guarantee the RDP filter cannot keep.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxacct import calibrate as _calibrate
from jaxacct._inputs import check_range
from jaxacct._numerics import accounting_device
from jaxacct._solver import bracket_search
from jaxacct.individual import DEFAULT_ORDERS, rdp_epsilon
from jaxacct.training.sampling import DPConfig
from jaxacct.training.accounting import planned_epsilon

# The answer's planned epsilon lies in [(1 - _CLOSE) target, target].
_CLOSE = 5e-3
_ROUNDS = 60  # evaluations of the planned epsilon at most


def _start(config: DPConfig, target: float) -> float:
  """The noise multiplier of the run's composition without extras, by ``jaxacct.calibrate``: a
  fixed batch is a Poisson one at sensitivity 2 (noise sigma / 2), the full batch q = 1; the
  RDP filter's guarantee is an RDP conversion, so the RDP accountant starts it."""
  accountant = "rdp" if config.accountant == "rdp_filter" else "pld"
  sigma = float(_calibrate.noise_multiplier(target, config.delta, config.sampling_rate,
                                            config.steps, accountant=accountant))
  return 2.0 * sigma if config.sampler == "fixed" else sigma


def _with_sigma(config, sigma, target):
  return dataclasses.replace(config, noise_multiplier=sigma, target_epsilon=target)


def _log_excess(config, sigma, target, device=None):
  """log(planned / target) at ``sigma``: > 0 above the target; decreasing in sigma."""
  return math.log(planned_epsilon(_with_sigma(config, sigma, target), device) / target)


def _smallest_sigma(excess, sigma):
  """The noise multiplier whose planned epsilon is in [(1 - _CLOSE), 1] times the target: ``sigma``
  where it already is, else ``_solver.bracket_search`` in log sigma from it (on the host, one
  planned epsilon per value; its first step sized by the excess, as epsilon falls at least
  like 1 / sigma), the end at or below the target."""
  band = -math.log1p(-_CLOSE)
  value = excess(sigma)
  if -band <= value <= 0.0:
    return sigma
  lo, hi = _calibrate.DOMAIN["noise_multiplier"]
  evaluate = lambda x: (np.array([value if x[0] == sigma else excess(float(x[0]))]), x)
  _, b, _, _, found = bracket_search(evaluate, np.array([sigma]), step=1e-3, lower=np.array([lo]),
                                     upper=np.array([hi]), iters=_ROUNDS, ftol=band,
                                     safe_end="b", slope=1.0)
  if not found[0]:
    raise ValueError("no noise multiplier brackets the target (the planned epsilon does not fall "
                     "with sigma here)")
  return float(b[0])


def _check_above_rdp_floor(target, delta):
  """Refuses a target the RDP filter cannot certify at any noise: its guarantee converts RDP at
  ``DEFAULT_ORDERS``, whose conversion alone costs epsilon > 0 however small the budget."""
  floor = float(rdp_epsilon(np.zeros(len(DEFAULT_ORDERS)), DEFAULT_ORDERS, delta))
  if target <= floor:
    raise ValueError(f"target_epsilon {target:g} is out of the RDP filter's reach at delta "
                     f"{delta:g}: its conversion at orders up to {max(DEFAULT_ORDERS):g} gives "
                     f"epsilon > {floor:.4g} whatever the noise (use the worst-case accountant "
                     f"or the bucket counter, or a larger target)")


def calibrate(config: DPConfig, target_epsilon, device=None) -> DPConfig:
  """``config`` with the noise multiplier at which the run certifies ``target_epsilon`` at its
  ``delta`` (and ``target_epsilon`` set, so the trainer checks it): the run's
  ``planned_epsilon`` at the answer is <= the target and >= 0.995 times it. Computed on
  ``device`` (default the CPU backend).

  ValueError on a target that no noise multiplier in jaxacct.calibrate's range reaches."""
  if not isinstance(config, DPConfig):
    raise TypeError(f"config must be a DPConfig; got {type(config).__name__}")
  check_range("target_epsilon", target_epsilon, 0.0, math.inf)
  target = float(target_epsilon)
  if config.accountant == "rdp_filter":
    _check_above_rdp_floor(target, config.delta)
  with accounting_device(device):
    excess = lambda sigma: _log_excess(config, sigma, target, device)
    return _with_sigma(config, _smallest_sigma(excess, _start(config, target)), target)


__all__ = ["calibrate"]
