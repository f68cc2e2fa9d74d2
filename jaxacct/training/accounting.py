"""The accounting of a training run, on the host: budgets, the worst-case epsilon, the report.

Everything here is host-side float64 accounting and runs on the CPU backend unless a
``device`` is asked for (``jaxacct._numerics.accounting_device``): a trainer builds, and
``privacy_report`` answers, on a TPU host (no complex128 FFT there) or beside a GPU that trains.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxacct import api, gdp
from jaxacct._numerics import accounting_device, host_values
from jaxacct.individual import (COUNTER_CERTIFIES, DEFAULT_RTOL, FILTER_CERTIFIES, bucket_counter,
                                gdp_filter, rdp_budget, rdp_filter)
from jaxacct.results import Bounds
from jaxacct.training.sampling import DPConfig

FILTERS = ("gdp_filter", "rdp_filter")
"""The ``DPConfig.accountant`` values that run an individual filter (each example leaves
training when its budget is spent)."""


def individual_accountant(config: DPConfig, examples=None):
  """The per-example accountant of ``config`` (None for "worst_case"), its ledger in float32, or
  float64 when x64 is enabled, over ``examples`` (default N; a shard's block on a mesh).

  Budgets: the GDP filter's mu is that of ``target_epsilon`` at ``delta`` when given, else that
  of T clipped DP-GD steps, sqrt(T) / sigma; the RDP filter's is the RDP of T worst-case steps
  (``rdp_budget``). Every example is then held to at least the planned run's worst case."""
  examples = config.num_examples if examples is None else examples
  return _accountant(config, jnp.zeros(()).dtype.name, examples)


@functools.lru_cache(maxsize=32)
def _accountant(config: DPConfig, dtype: str, examples: int):
  """``individual_accountant`` with its ledger's dtype (built once per configuration, dtype and
  count; its budgets are computed on the host)."""
  sigma, clip, q = config.noise_multiplier, config.clip_norm, config.sampling_rate
  with accounting_device():
    if config.accountant == "gdp_filter":
      if config.target_epsilon is None:
        mu = math.sqrt(config.steps) / sigma
      else:  # (lowered so that the filter's guarantee, B sqrt(1 + rtol), stays <= the target)
        mu = gdp.mu_of_eps_delta(config.target_epsilon, config.delta)
        mu = float(mu) / math.sqrt(1.0 + DEFAULT_RTOL) * (1.0 - 1e-12)
      return gdp_filter(float(mu), clip, sigma, examples, config.may_return, dtype=dtype)
    if config.accountant == "rdp_filter":
      return rdp_filter(rdp_budget(sigma, q, config.steps), clip, sigma, examples,
                        config.may_return, sampling_rate=q, dtype=dtype)
    if config.accountant == "bucket_counter":
      return bucket_counter(sigma, clip, q, examples, dtype=dtype)
  return None


def planned_epsilon(config: DPConfig, device=None) -> float:
  """The epsilon at ``config.delta`` a run of ``config`` certifies: the worst-case upper of its
  T steps (its own sampler's composition, with a small buffer's allowance) and, for the filters,
  the epsilon each example is held to, whichever is larger. Computed on ``device`` (default the
  CPU backend)."""
  with accounting_device(device):
    planned = float(worst_case_epsilon(config, config.steps, device=device).upper)
    if config.accountant in FILTERS:
      planned = max(planned, individual_accountant(config).guarantee(config.delta))
  return planned


def check_budget(config: DPConfig):
  """Refuses a configuration whose ``planned_epsilon`` exceeds ``target_epsilon``."""
  if config.target_epsilon is None:
    return
  planned = planned_epsilon(config)
  if planned > config.target_epsilon:
    raise ValueError(
        f"noise_multiplier {config.noise_multiplier:g} does not reach target_epsilon "
        f"{config.target_epsilon:g}: {config.steps} steps of this sampler ({config.sampler}, "
        f"q = {config.sampling_rate:.6g}) with the {config.accountant} accountant give epsilon "
        f"<= {planned:.4g} at delta {config.delta:g} (jaxacct.training.calibrate(config, "
        f"{config.target_epsilon:g}) sets the noise multiplier this run needs)")


def _on_host(bounds: Bounds) -> Bounds:
  """Bounds as numpy values (float64 outside an x64 scope too)."""
  return jax.tree_util.tree_map(np.asarray, bounds)


def worst_case_epsilon(config: DPConfig, steps: int, delta=None, device=None) -> Bounds:
  """Certified epsilon at ``delta`` (default the config's) of ``steps`` steps of ``config``,
  computed on ``device`` (default the CPU backend).

  A Poisson buffer below N + 1 overflows with probability beta per step; the run then differs
  from Poisson DP-SGD on an event of probability <= T beta under either dataset, so its delta is
  at most delta_Poisson(eps) + (1 + e^eps) T beta. The upper bound solves that by a short
  monotone iteration, each candidate checked with a margin of 1/2 in eps."""
  delta = config.delta if delta is None else float(delta)
  if steps == 0:
    zero = np.zeros(())
    return Bounds(zero, zero, zero, np.zeros((), np.int32))
  with accounting_device(device):
    return _worst_case(config.composition(steps), delta, steps * config.overflow_per_step)


def _worst_case(composition, delta, slack) -> Bounds:
  """``worst_case_epsilon`` of a composition whose run may differ on an event of probability
  ``slack``."""
  if slack == 0.0:
    return _on_host(api.epsilon(composition, delta))
  eps = 0.0
  for _ in range(8):
    allowance = (1.0 + math.exp(min(eps + 0.5, 700.0))) * slack
    if allowance >= delta:
      break
    upper = api.epsilon(composition, delta - allowance)
    if float(upper.upper) <= eps + 0.5:  # its allowance at eps + 1/2 covers its own
      lower = api.epsilon(composition, min(delta + allowance, 0.5))
      return _on_host(Bounds(lower.lower, upper.estimate, upper.upper,
                             upper.status | lower.status))
    eps = float(upper.upper)
  raise ValueError(f"the Poisson buffer's overflow allowance ({slack:.3g} per run) is not small "
                   f"against delta = {delta:g}: raise capacity")


@dataclasses.dataclass(frozen=True)
class PrivacyReport:
  """Where a run's privacy stands.

  ``epsilon``: certified bounds on the worst-case epsilon at ``delta`` of the ``steps``
  accounted (the composition of ``config.composition(steps)``, plus the overflow allowance of a
  Poisson buffer below N + 1). ``guarantee``: the epsilon every example is held to by a filter
  (None without one). ``individual``: quantiles of the examples' epsilons so far (their
  odometers: GDP for the GDP filter, RDP for the RDP filter and the bucket counter);
  ``certifies`` says what they certify (a filter's guarantee holds under full adaptivity, a
  bucket counter's individual epsilon only for the realised norms taken as fixed in advance).
  ``active``: examples in the latest step (admitted by a filter; all listed ones otherwise).
  """

  epsilon: Bounds
  delta: float
  steps: int
  refused: int
  guarantee: float | None
  individual: dict | None
  active: int | None
  config: DPConfig
  certifies: str | None = None

  def __str__(self):
    lines = [f"{self.steps} steps ({self.config.sampler} sampling, q = "
             f"{self.config.sampling_rate:.6g}, sigma = {self.config.noise_multiplier:g}, "
             f"C = {self.config.clip_norm:g}): worst-case epsilon <= "
             f"{float(self.epsilon.upper):.4f} at delta = {self.delta:g}"]
    if self.refused:
      lines.append(f"{self.refused} steps refused (batch buffer overflow)")
    if self.guarantee is not None:
      lines.append(f"every example held to epsilon <= {self.guarantee:.4f} by its filter")
    if self.individual is not None:
      shown = ", ".join(f"{int(100 * q)}%: {v:.4f}" for q, v in self.individual.items())
      lines.append(f"individual epsilon quantiles: {shown}")
      lines.append(self.certifies)
    if self.active is not None:
      lines.append(f"{self.active} of {self.config.num_examples} examples active")
    return "\n".join(lines)


QUANTILES = (0.0, 0.1, 0.5, 0.9, 1.0)
"""The quantiles of the individual epsilons that ``privacy_report`` gives by default."""


def privacy_report(ledger, delta=None, quantiles=QUANTILES, device=None) -> PrivacyReport:
  """The worst-case certified epsilon, the individual epsilon quantiles and the active-set size
  of a run, from its train state (or its ``Ledger``): host side, on ``device`` (default the CPU
  backend); cheap enough to call every few hundred steps. With several processes every process
  calls it and gets the same report."""
  ledger = getattr(ledger, "ledger", ledger)
  config = ledger.config
  delta = config.delta if delta is None else float(delta)
  steps, refused, kept = host_values((ledger.steps, ledger.refused, ledger.individual))
  accountant = individual_accountant(config)
  guarantee = individual = active = certifies = None
  with accounting_device(device):
    if accountant is not None:
      filtered = config.accountant in FILTERS
      certifies = FILTER_CERTIFIES if filtered else COUNTER_CERTIFIES
      eps = np.asarray(accountant.odometer(jax.tree_util.tree_map(jnp.asarray, kept), delta),
                       np.float64)
      individual = dict(zip(quantiles, np.quantile(eps, quantiles, method="higher").tolist()))
      if filtered:
        guarantee = accountant.guarantee(delta)
        active = int(np.sum(kept.active))
      else:
        active = config.num_examples
    epsilon = worst_case_epsilon(config, int(steps), delta, device=device)
  return PrivacyReport(epsilon, delta, int(steps), int(refused), guarantee, individual, active,
                       config, certifies)


__all__ = ["FILTERS", "PrivacyReport", "QUANTILES", "check_budget", "individual_accountant",
           "planned_epsilon", "privacy_report", "worst_case_epsilon"]
