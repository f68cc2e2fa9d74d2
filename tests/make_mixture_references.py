"""Regenerates tests/data/mixture_references.json with dp-accounting (a test-only dependency).

Five mixture-of-Gaussians settings (three-atom sensitivity vectors, with and without a zero
atom, binomial and other weights), each composed T times: dp-accounting's PLD of
``MixtureOfGaussiansDpEvent`` (add-or-remove, the worse of both directions) at discretisation
1e-4, pessimistic (connect-the-dots: an upper bound of the truth up to its truncation of
e^-50 mass) and optimistic (privacy buckets: a lower bound). Run:
python tests/make_mixture_references.py  (a few minutes on 2 cores).
"""

from __future__ import annotations

import json
import pathlib
import time

from dp_accounting.pld import privacy_loss_distribution as pldlib

OUT = pathlib.Path(__file__).parent / "data" / "mixture_references.json"
SETTINGS = [  # sigma, sensitivities, probabilities, T, delta
    (1.0, [0.0, 1.0, 2.0], [0.81, 0.18, 0.01], 100, 1e-5),
    (2.0, [0.0, 1.0, 2.0], [0.9025, 0.095, 0.0025], 1000, 1e-6),
    (0.8, [0.0, 1.0, 2.0], [0.98, 0.0199, 0.0001], 300, 1e-5),
    (1.5, [0.5, 1.0, 3.0], [0.5, 0.3, 0.2], 20, 1e-4),
    (3.0, [0.0, 2.0, 4.0], [0.95, 0.045, 0.005], 500, 1e-7),
]


def epsilon(sigma, sensitivities, probabilities, steps, delta, pessimistic):
  pld = pldlib.from_mixture_gaussian_mechanism(
      sigma, sensitivities, probabilities, pessimistic_estimate=pessimistic,
      value_discretization_interval=1e-4, use_connect_dots=pessimistic)
  return pld.self_compose(steps).get_epsilon_for_delta(delta)


def main():
  rows = []
  for sigma, sens, probs, steps, delta in SETTINGS:
    start = time.time()
    upper = epsilon(sigma, sens, probs, steps, delta, True)
    lower = epsilon(sigma, sens, probs, steps, delta, False)
    rows.append(dict(sigma=sigma, sensitivities=sens, probabilities=probs, steps=steps,
                     delta=delta, dpa_pessimistic=upper, dpa_optimistic=lower))
    print(rows[-1], f"{time.time() - start:.1f} s", flush=True)
  OUT.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
  main()
