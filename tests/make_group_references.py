"""Regenerates tests/data/group_references.json with dp-accounting (a test-only dependency).

Thirteen group-level DP-SGD settings (Ganesh 2024): nine with Poisson sampling (Binomial(k, q)
sensitivities) and four with a fixed batch (sensitivities 2m, m ~ Hypergeometric(B, n + k, k)),
k from 1 to 5 (dp-accounting takes minutes per setting at k = 4 and T = 2000; the larger k of the
paper's table are asserted from the issue's figures in the tests). For each, dp-accounting's PLD of ``MixtureOfGaussiansDpEvent``'s mechanism at
discretisation 1e-4, pessimistic (connect-the-dots: an upper bound of the truth up to its
truncation of e^-50 mass) and optimistic (privacy buckets: a lower bound), composed T times:
epsilon(delta) of each direction (remove, add) and of the worse, and delta at one epsilon.
The weights come from scipy (``binom.pmf``, ``hypergeom.pmf``), not from jaxacct. Run:
python tests/make_group_references.py  (about twenty minutes on 2 cores).
"""

from __future__ import annotations

import json
import pathlib
import time

import numpy as np
from dp_accounting.pld import privacy_loss_distribution as pldlib
from scipy import stats

OUT = pathlib.Path(__file__).parent / "data" / "group_references.json"
POISSON = [  # sigma, q, T, k, delta
    (1.0, 0.01, 2000, 1, 1e-6), (1.0, 0.01, 2000, 2, 1e-6), (1.0, 0.01, 2000, 4, 1e-6),
    (2.0, 0.01, 2000, 3, 1e-6), (0.7, 0.01, 1000, 2, 1e-6), (3.0, 0.05, 500, 3, 1e-8),
    (1.5, 0.002, 3000, 5, 1e-5), (0.8, 0.1, 100, 2, 1e-5), (1.0, 1.0, 10, 3, 1e-6),
]
FIXED = [  # sigma, B, n, T, k, delta
    (2.0, 500, 50000, 2000, 1, 1e-6), (1.5, 64, 1437, 660, 3, 1e-5),
    (4.0, 256, 2000, 300, 5, 1e-7), (2.0, 500, 50000, 2000, 4, 1e-6),
]


def _composed(sigma, sens, probs, steps, pessimistic):
  keep = probs > 0.0
  pld = pldlib.from_mixture_gaussian_mechanism(
      sigma, list(sens[keep]), list(probs[keep]), pessimistic_estimate=pessimistic,
      value_discretization_interval=1e-4, use_connect_dots=pessimistic)
  return pld.self_compose(steps)


def _row(sigma, sens, probs, steps, delta, **setting):
  row = dict(setting, sigma=sigma, steps=steps, delta=delta)
  for name, pessimistic in (("pessimistic", True), ("optimistic", False)):
    pld = _composed(sigma, sens, probs, steps, pessimistic)
    row[f"{name}_remove"] = pld._pmf_remove.get_epsilon_for_delta(delta)  # pylint: disable=protected-access
    row[f"{name}_add"] = pld._pmf_add.get_epsilon_for_delta(delta)  # pylint: disable=protected-access
    row[name] = pld.get_epsilon_for_delta(delta)
    if name == "pessimistic":
      row["at_epsilon"] = round(0.8 * row[name], 3)
    row[f"{name}_delta"] = pld.get_delta_for_epsilon(row["at_epsilon"])
  return row


def main():
  rows = []
  for sigma, q, steps, k, delta in POISSON:
    start = time.time()
    sens = np.arange(k + 1, dtype=float)
    probs = stats.binom.pmf(np.arange(k + 1), k, q)
    rows.append(_row(sigma, sens, probs, steps, delta, sampling="poisson", sampling_rate=q,
                     group_size=k))
    print(rows[-1], f"{time.time() - start:.1f} s", flush=True)
  for sigma, b, n, steps, k, delta in FIXED:
    start = time.time()
    m = np.arange(k + 1)
    probs = stats.hypergeom.pmf(m, n + k, k, b)
    rows.append(_row(sigma, 2.0 * m, probs, steps, delta, sampling="fixed", batch_size=b,
                     dataset_size=n, group_size=k))
    print(rows[-1], f"{time.time() - start:.1f} s", flush=True)
    OUT.write_text(json.dumps(rows, indent=1) + "\n")  # (as it goes: minutes per row)
  OUT.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
  main()
