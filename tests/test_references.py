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

import pytest

import jaxacct
from reference_cases import REFERENCES, composition, label


@pytest.mark.slow
@pytest.mark.parametrize("row", REFERENCES, ids=label)
def test_bounds_bracket_the_references(row):
  r = jaxacct.epsilon(composition(row), row["delta"])
  lower, estimate, upper = float(r.lower), float(r.estimate), float(r.upper)
  assert int(r.status) == 0
  best_upper = min(row["dpa_2e5"], row["dpa_1e5"])
  assert lower <= best_upper
  if "prv_lower" in row:
    assert upper >= row["prv_lower"]
  assert lower <= estimate <= upper
  assert abs(estimate - best_upper) <= 1e-3 * max(1.0, best_upper)
  assert upper - lower <= 0.022


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
