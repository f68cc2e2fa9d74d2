"""The PLD accountant against dp-accounting and prv-accountant on 67 stored settings.

``tests/data/references.json`` is produced by ``tests/make_references.py`` (random settings over
q 1e-4..1, sigma 0.5..10, T 1..1e5, delta 1e-10..1e-3, heterogeneous schedules, replace-one; the
libraries are test-only dependencies). Comparisons use only what the references certify:

* dp-accounting's pessimistic (connect-the-dots) epsilon is an upper bound of the truth at every
  discretisation, so the smaller of its two values must be >= our ``lower``;
* prv-accountant's lower value is a certified lower bound, so it must be <= our ``upper``;
* the estimate must be within 1e-3 max(1, eps) of dp-accounting's best (smallest) value.

(Extrapolating dp-accounting in its grid step is not safe: on large-epsilon settings its value
grows when the grid is refined, by ~1e-4.)
"""

import jax
import numpy as np
import pytest

import jaxacct
from reference_cases import REFERENCES, composition, label


def _is_dpsgd(row):
  """One Poisson-subsampled Gaussian entry (q < 1) under add/remove: DP-SGD."""
  return (row["relation"] == "add_remove" and len(row["entries"]) == 1
          and row["entries"][0][1] < 1.0)


def _buckets(rows, spread=2.0):
  """``rows`` in buckets whose own default plans' FFT sizes lie within ``spread`` of each other,
  smallest first: [(row, its own plan), ...] each."""
  from jaxacct.pld import make_plan
  planned = sorted(((make_plan(composition(row), row["delta"]), i) for i, row in enumerate(rows)),
                   key=lambda pair: (pair[0].fft_size, pair[1]))
  buckets, first = [], None
  for plan, i in planned:
    if first is None or plan.fft_size > spread * first:
      buckets.append([])
      first = plan.fft_size
    buckets[-1].append((rows[i], plan))
  return buckets


DPSGD_BUCKETS = _buckets([row for row in REFERENCES if _is_dpsgd(row)])


@pytest.mark.slow
@pytest.mark.parametrize("bucket", DPSGD_BUCKETS,
                         ids=lambda bucket: f"{len(bucket)}-from-{label(bucket[0][0])}")
def test_dpsgd_settings_bracket_the_references_on_shared_sizes(bucket):
  """The 57 DP-SGD rows, a bucket of settings whose own default plans are within 2x in FFT size
  at a time. Each setting is one front-door call (``jaxacct.epsilon(..., plan=...)``) on its own
  plan with the bucket's static sizes (``plan.stack_plans``): its own window, tails and band
  needs, its grid step divided by the bucket's largest FFT over its own (1-2x finer). The
  front door then runs the band, one program or two as it chooses on that plan: the 9 settings
  their own calls answer from the band take the same path here (and some others move to it on
  the larger sizes), the rest run as two programs. A bucket compiles one program a
  path where each setting compiled its own (~6 s each under the suite's load; the file took
  491 s of a worker's time in the suite, 112 s alone now). The default plan's own grid step is
  checked by the ten rows below and test_closed_forms' tightness tests."""
  from jaxacct.pld import plan as _plan
  shared = _plan.stack_plans([own for _, own in bucket])
  for i, (row, own) in enumerate(bucket):
    plan = jax.tree_util.tree_map(lambda leaf: leaf[i], shared)
    assert plan.fft_size * float(plan.grid_step) == pytest.approx(
        own.fft_size * float(own.grid_step), rel=1e-12)  # (its own window)
    assert float(own.grid_step) / 2 <= float(plan.grid_step) <= float(own.grid_step)
    r = jaxacct.epsilon(composition(row), row["delta"], plan=plan)
    _assert_meets(row, float(r.lower), float(r.estimate), float(r.upper), int(r.status),
                  label(row))


@pytest.mark.slow
@pytest.mark.parametrize("row", [row for row in REFERENCES if not _is_dpsgd(row)], ids=label)
def test_bounds_bracket_the_references(row):
  """The other rows (replace-one, full batches, heterogeneous schedules), one call each."""
  r = jaxacct.epsilon(composition(row), row["delta"])
  _assert_meets(row, float(r.lower), float(r.estimate), float(r.upper), int(r.status))


def _assert_meets(row, lower, estimate, upper, status, name=""):
  """One setting's bounds against its stored references (what each certifies: module docstring)."""
  assert status == 0, name
  best_upper = min(row["dpa_2e5"], row["dpa_1e5"])
  assert lower <= best_upper, name
  if "prv_lower" in row:
    assert upper >= row["prv_lower"], name
  assert lower <= estimate <= upper, name
  assert abs(estimate - best_upper) <= 1e-3 * max(1.0, best_upper), name
  assert upper - lower <= 0.022, name


def test_the_host_estimate_meets_the_references():
  """``pld.host.epsilon`` (numpy, nothing compiled: a calibration's start) on every third stored
  setting its FFT serves: within the stored references as the accountant's estimate is, and
  above prv-accountant's certified lower bound."""
  from jaxacct.pld import host, make_plan
  served = 0
  for row in REFERENCES[::3]:
    comp = composition(row)
    plan = make_plan(comp, row["delta"])
    if plan.fft_size > host.HOST_POINTS:
      continue
    served += 1
    eps, _ = host.epsilon(comp, row["delta"], plan)
    best_upper = min(row["dpa_2e5"], row["dpa_1e5"])
    assert abs(eps - best_upper) <= 1e-3 * max(1.0, best_upper), label(row)
    if "prv_lower" in row:
      assert eps >= row["prv_lower"], label(row)
  assert served >= 15


def test_reference_file_covers_the_ranges():
  rates = [q for row in REFERENCES for _, q, _ in row["entries"]]
  sigmas = [s for row in REFERENCES for s, _, _ in row["entries"]]
  steps = [c for row in REFERENCES for _, _, c in row["entries"]]
  deltas = [row["delta"] for row in REFERENCES]
  assert len(REFERENCES) >= 55
  assert min(rates) < 2e-4 and max(rates) == 1.0
  assert min(sigmas) < 0.7 and max(sigmas) > 8.0
  assert min(steps) <= 2 and max(steps) > 5e4
  assert min(deltas) < 3e-10 and max(deltas) > 5e-4
  assert sum(len(row["entries"]) > 1 for row in REFERENCES) >= 4
  assert sum(row["relation"] == "replace_one" for row in REFERENCES) >= 3


def test_a_batch_of_diverse_settings_is_planned_setting_by_setting(monkeypatch):
  """The stored DP-SGD settings of few steps (q 1e-4..0.8, sigma 1.3..9, T 1..120, delta
  1e-10..1e-3) as one batch: one grid serving them all would take the finest step of one and
  the widest window of another (~1.4e9 grid points); each setting sized apart, the static sizes
  shared (``plan.batch_plan``), takes ~5000x fewer. Each setting's bounds meet its references
  as a call of its own does."""
  from jaxacct.pld import accountant, plan as _plan
  rows = [row for row in REFERENCES if row["relation"] == "add_remove"
          and len(row["entries"]) == 1 and row["entries"][0][2] <= 120
          and row["entries"][0][0] >= 1.3 and row["entries"][0][1] < 1.0]
  sigma, q, steps = (np.array([row["entries"][0][i] for row in rows]) for i in range(3))
  delta = np.array([row["delta"] for row in rows])
  shared = _plan.make_plan(jaxacct.dpsgd_composition(sigma, q, steps), delta)
  plans, run = [], accountant._run

  def recording(quantity, flat, plan, *args, **kwargs):
    plans.append(plan)  # (one grid for all would run for minutes: refused here at once)
    assert np.shape(plan.grid_step) == (len(rows),), "the batch was planned as one grid"
    return run(quantity, flat, plan, *args, **kwargs)

  monkeypatch.setattr(accountant, "_run", recording)
  r = jaxacct.dpsgd_epsilon(sigma, q, steps, delta)
  monkeypatch.undo()
  assert len(rows) >= 12 and len(plans) == 1
  assert 1000 * _plan.plan_points(plans[0]) < _plan.plan_points(shared)
  for i, row in enumerate(rows):
    assert "prv_lower" in row
    _assert_meets(row, float(r.lower[i]), float(r.estimate[i]), float(r.upper[i]),
                  int(r.status[i]))
