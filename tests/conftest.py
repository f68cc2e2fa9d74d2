"""Shared helpers for the test suite. Reference libraries are test-only dependencies."""

import csv
import math
import os
import pathlib
import tempfile

import numpy as np
import pytest
from scipy import optimize, stats


# Tests never write into the user's compilation cache (the CLI's; see test_inputs for its test).
os.environ["JAXACCT_NO_CACHE"] = "1"
# One compilation cache for the session, shared by the pytest workers and every subprocess a
# test starts (notebooks, the CLI, forced-device runs): a program compiled once is read, not
# compiled again, elsewhere. Set before jax is imported; the workers and subprocesses inherit it
# (a fresh directory per session: a run never reads another run's programs).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxacct-test-xla-")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"


# XLA's CPU kernels compiled by its elemental emitters, not the (default) fusion emitters:
# compiling is ~60 % of the suite's time (benchmarks/profile_tests.py), and a PLD program
# compiles ~1.5-2.5 s sooner this way (benchmarks/README.md, "Where the test suite's time
# goes"). The answers agree to round-off; test_numerics' two-emitter test checks that the
# default build answers as this one does. Set before jax starts its backend; the workers and
# subprocesses inherit it (scale_runs.py appends its device count).
# (The command line runs the same way: jaxacct.cli.quick_compile_flags.)
from jaxacct.cli import quick_compile_flags  # noqa: E402  (after the cache's variables)
os.environ["XLA_FLAGS"] = quick_compile_flags(os.environ.get("XLA_FLAGS", ""))


# The longest tests (a minute or more each: notebooks, multi-process and mesh runs, the docs'
# tours, the demo) run first, so the two workers end on short tests and finish together
# (with them last, one worker idled for a minute while the other ran a notebook).
_LONGEST_FIRST = ("test_notebooks.py", "test_scale.py", "test_readme.py", "test_demo.py")


def pytest_collection_modifyitems(items):
  rank = lambda item: next((i for i, name in enumerate(_LONGEST_FIRST)
                            if item.nodeid.split("::")[0].endswith(name)), len(_LONGEST_FIRST))
  items.sort(key=rank)  # (stable: the order within each group is kept)


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
  while gaussian_delta(hi, mu) == 0.0:  # (a tiny mu: delta underflows far below epsilon 1)
    hi /= 2.0
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


def laplace_delta(eps, e0, k):
  """Exact delta(eps) of k = 1 or 2 Laplace steps with e0 = sensitivity / scale, by quadrature
  of the loss law: atoms at +e0 (mass 1/2) and -e0 (e^{-e0}/2), density e^{(l - e0)/2}/4 on
  (-e0, e0) under P."""
  from scipy import integrate
  atoms = [(e0, 0.5), (-e0, 0.5 * math.exp(-e0))]
  density = lambda l: 0.25 * math.exp(0.5 * (l - e0))
  g = lambda s: max(0.0, -math.expm1(eps - s))
  quad = lambda f, lo, hi: integrate.quad(f, lo, hi, epsabs=1e-15, epsrel=1e-13, limit=200)[0]
  if k == 1:
    return sum(w * g(a) for a, w in atoms) + quad(lambda l: density(l) * g(l), -e0, e0)
  assert k == 2
  total = sum(wa * wb * g(a + b) for a, wa in atoms for b, wb in atoms)
  total += 2 * sum(w * quad(lambda l: density(l) * g(a + l), -e0, e0) for a, w in atoms)
  inner = lambda l1: quad(lambda l2: density(l2) * g(l1 + l2), max(-e0, eps - l1), e0)
  return total + quad(lambda l1: density(l1) * inner(l1), -e0, e0)


def epsilon_of(delta_fn, delta, high):
  """The smallest eps >= 0 with delta_fn(eps) <= delta (delta_fn non-increasing; brentq in log
  delta, to 1e-13)."""
  if delta_fn(0.0) <= delta:
    return 0.0
  f = lambda e: math.log(max(delta_fn(e), 1e-300)) - math.log(delta)
  return optimize.brentq(f, 0.0, high, xtol=1e-13, rtol=1e-15)


# The promise of the UNRELIABLE bit (README, "Accuracy"; results.STATUS_TEXT): an estimate
# without it is within FLAG_PROMISE x max(1, eps) of the truth, measured by
# benchmarks/flag_sweep.py (600 random DP-SGD settings against the certified PLD accountant).
# Tests read the PLD's estimate at eps_error 1e-3 as the truth, within ~1e-5 x max(1, eps) of
# it: REFERENCE_SLACK allows for that.
FLAG_PROMISE = 2.5e-4
REFERENCE_SLACK = 2e-5
FLAG_SWEEP = pathlib.Path(__file__).parent.parent / "benchmarks" / "data" / "flag_sweep.csv"


def flag_sweep_rows(count, seed):
  """``count`` rows of the flag sweep's stored PLD references (q < 1), drawn at random."""
  with open(FLAG_SWEEP, newline="") as f:
    rows = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
  rows = [row for row in rows if row["q"] < 1.0 and row["status"] == 0]
  pick = np.random.default_rng(seed).choice(len(rows), count, replace=False)
  return [rows[i] for i in sorted(pick)]
