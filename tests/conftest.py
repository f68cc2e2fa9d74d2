"""Shared helpers for the test suite. Reference libraries are test-only dependencies."""

import math
import os

import numpy as np
import pytest
from scipy import optimize, stats


# Tests never write into the user's compilation cache (the CLI's; see test_inputs for its test).
os.environ["JAXACCT_NO_CACHE"] = "1"


def gaussian_delta(eps, mu):
  """Exact delta(eps) of the mu-GDP curve (composed Gaussians), in log space for tiny values."""
  a = stats.norm.logcdf(-eps / mu + mu / 2)
  b = eps + stats.norm.logcdf(-eps / mu - mu / 2)
  return math.exp(a) * -math.expm1(b - a)


def gaussian_epsilon(delta, mu):
  """Exact epsilon(delta) of the mu-GDP curve (root in log delta, to 1e-13)."""
  if gaussian_delta(0.0, mu) <= delta:
    return 0.0
  f = lambda e: math.log(gaussian_delta(e, mu)) - math.log(delta)
  hi = 1.0
  while f(hi) > 0:
    hi *= 2
  return optimize.brentq(f, 0.0, hi, xtol=1e-14, rtol=1e-15)


def subsampled_gaussian(q, sigma, n):
  """n steps of the Poisson-subsampled Gaussian (DP-SGD) as a jaxacct Composition."""
  from jaxacct import models
  from jaxacct.composition import Composition
  return Composition.of((models.PoissonSampled(models.Gaussian(sigma), q), n))


def pure_dp_delta(eps, eps0, k):
  """Exact delta(eps) of k-fold pure eps0-DP (binary randomized response, KOV15)."""
  j = np.arange(k + 1)
  p = math.exp(eps0) / (1 + math.exp(eps0))
  weights = stats.binom.pmf(j, k, p)
  losses = eps0 * (2 * j - k)
  return float(np.sum(weights * np.maximum(0.0, -np.expm1(eps - losses))))


@pytest.fixture(scope="session")
def x64_off():
  import jax
  assert not jax.config.jax_enable_x64, "the test process must start with x64 disabled"


def _memory_maps() -> int:
  try:
    with open("/proc/self/maps") as maps:
      return sum(1 for _ in maps)
  except OSError:  # not Linux
    return 0


@pytest.fixture(autouse=True)
def _release_compiled_programs():
  """Drops JAX's compiled programs once the process holds many memory maps.

  Every compiled XLA:CPU program keeps its own mappings (a PLD program ~700); the whole suite
  compiles hundreds of programs, and past the kernel's vm.max_map_count (65530 here) the next
  compilation crashes the process. Clearing the caches releases them.
  """
  yield
  if _memory_maps() > 30_000:
    import jax
    jax.clear_caches()
