"""Regenerates tests/data/references.json with the reference libraries (test-only dependencies).

Settings are drawn at random (fixed seed) across the ranges of the acceptance criteria:
q in [1e-4, 1], sigma in [0.5, 10], T in [1, 1e5], delta in [1e-10, 1e-3], plus heterogeneous
schedules and replace-one. For each: dp-accounting's PLD accountant (pessimistic, connect-the-dots,
a certified upper bound up to round-off) at discretisations 2e-5 and 1e-5, whose O(h^2) bias gives
the Richardson-extrapolated reference ``reference = e(1e-5) - (e(2e-5) - e(1e-5)) / 3``, and
prv-accountant's (lower, estimate, upper) as a second opinion. Settings with epsilon > 50 are
dropped. Run:  python tests/make_references.py  (tens of minutes on 2 cores).
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time

import numpy as np

import dp_accounting
from dp_accounting.pld import privacy_loss_distribution as pldlib
from prv_accountant import PRVAccountant, PoissonSubsampledGaussianMechanism, GaussianMechanism

OUT = pathlib.Path(__file__).parent / "data" / "references.json"
REL = dp_accounting.NeighboringRelation


def dpa_pld(entries, vdi, relation):
  pld = None
  for sigma, q, count in entries:
    step = pldlib.from_gaussian_mechanism(standard_deviation=sigma, sampling_prob=q,
                                          value_discretization_interval=vdi,
                                          neighboring_relation=relation).self_compose(int(count))
    pld = step if pld is None else pld.compose(step)
  return pld


def prv_eps(entries, delta, eps_error):
  prvs = [GaussianMechanism(noise_multiplier=s) if q == 1.0 else
          PoissonSubsampledGaussianMechanism(noise_multiplier=s, sampling_probability=q)
          for s, q, _ in entries]
  counts = [int(c) for _, _, c in entries]
  acc = PRVAccountant(prvs=prvs, eps_error=eps_error, delta_error=delta / 1000,
                      max_self_compositions=counts)
  return acc.compute_epsilon(delta=delta, num_self_compositions=counts)


def reference(entries, delta, relation="add_remove"):
  rel = REL.ADD_OR_REMOVE_ONE if relation == "add_remove" else REL.REPLACE_ONE
  t0 = time.time()
  coarse = dpa_pld(entries, 1e-3, rel).get_epsilon_for_delta(delta)
  if not math.isfinite(coarse) or coarse > 50:
    return None
  e2 = dpa_pld(entries, 2e-5, rel).get_epsilon_for_delta(delta)
  e1 = dpa_pld(entries, 1e-5, rel).get_epsilon_for_delta(delta)
  row = dict(entries=[list(map(float, e)) for e in entries], delta=delta, relation=relation,
             dpa_2e5=e2, dpa_1e5=e1, reference=e1 - (e2 - e1) / 3.0)
  if relation == "add_remove":
    try:
      lo, est, hi = prv_eps(entries, delta, 0.01)
      row.update(prv_lower=lo, prv_estimate=est, prv_upper=hi)
    except Exception as err:  # noqa: BLE001 - recorded, the row keeps its dp-accounting values
      row["prv_error"] = str(err)[:200]
  row["seconds"] = time.time() - t0
  return row


def settings(seed=20261122, count=70):
  rng = np.random.default_rng(seed)
  out = []
  while len(out) < count:
    q = float(10 ** rng.uniform(-4, 0)) if rng.uniform() > 0.08 else 1.0
    sigma = float(np.exp(rng.uniform(np.log(0.5), np.log(10))))
    steps = int(round(10 ** rng.uniform(0, 5)))
    delta = float(10 ** rng.uniform(-10, -3))
    out.append(([(sigma, q, steps)], delta, "add_remove"))
  out += [
      ([(1.0, 0.01, 1000), (2.0, 0.02, 500)], 1e-5, "add_remove"),
      ([(0.8, 0.005, 100), (8.0, 1.0, 200)], 1e-6, "add_remove"),
      ([(0.9, 0.01, 1000), (1.0, 0.01, 1000), (1.1, 0.01, 1000)], 1e-5, "add_remove"),
      ([(3.0, 0.1, 50), (1.5, 0.001, 20000)], 1e-8, "add_remove"),
      ([(1.0, 0.01, 1000)], 1e-5, "replace_one"),
      ([(2.0, 0.05, 3000)], 1e-7, "replace_one"),
      ([(5.0, 1.0, 40)], 1e-6, "replace_one"),
      ([(0.7, 0.003, 20000)], 1e-9, "replace_one"),
  ]
  return out


def main():
  rows = []
  for entries, delta, relation in settings():
    row = reference(entries, delta, relation)
    if row is not None:
      rows.append(row)
      print(json.dumps(row), flush=True)
  OUT.write_text(json.dumps(rows, indent=1))
  print(f"{len(rows)} settings written to {OUT}", file=sys.stderr)


if __name__ == "__main__":
  main()
