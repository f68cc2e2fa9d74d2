"""Regenerates tests/data/opacus_references.json with Opacus's own ``get_noise_multiplier``.

Opacus is not a test dependency (it needs torch): run this once in a separate environment,
    python3 -m venv /tmp/opacus && /tmp/opacus/bin/pip install torch==2.13.0 opacus==1.6.0
    /tmp/opacus/bin/python tests/make_opacus_references.py
and commit the JSON; the tests read the stored values and never import Opacus (this script does
not import jaxacct either). For each setting: the steps Opacus counts from ``epochs``
(``int(epochs / sample_rate)``), and Opacus's sigma and the epsilon its accountant gives at that
sigma, for the "rdp" and "prv" accountants, at its default ``epsilon_tolerance`` (0.01) and at
1e-5 (close to each accountant's own root). About a minute on 2 cores.
"""

from __future__ import annotations

import json
import pathlib
import time

import opacus
from opacus.accountants import create_accountant
from opacus.accountants.utils import get_noise_multiplier

OUT = pathlib.Path(__file__).parent / "data" / "opacus_references.json"
SETTINGS = [  # target epsilon, target delta, sample rate, {"steps": T} or {"epochs": E}
    (2.0, 1e-5, 0.01, {"steps": 1000}),
    (2.0, 1e-5, 0.01, {"epochs": 10}),
    (1.0, 1e-5, 0.004, {"epochs": 3}),
    (0.5, 1e-5, 0.02, {"steps": 500}),
    (8.0, 1e-6, 0.05, {"steps": 200}),
    (3.0, 1e-5, 0.01, {"epochs": 0.29}),
]
TOLERANCES = (0.01, 1e-5)


def _epsilon_at(accountant, sigma, sample_rate, steps, delta):
  """The epsilon Opacus's accountant reports for ``steps`` steps at ``sigma``."""
  acc = create_accountant(mechanism=accountant)
  acc.history = [(sigma, sample_rate, steps)]
  return acc.get_epsilon(delta=delta)


def main():
  rows = []
  for eps, delta, rate, length in SETTINGS:
    steps = length.get("steps")
    if steps is None:
      steps = int(length["epochs"] / rate)  # (what get_noise_multiplier counts)
    row = dict(target_epsilon=eps, target_delta=delta, sample_rate=rate, **length,
               opacus_steps=steps)
    for accountant in ("rdp", "prv"):
      for tol in TOLERANCES:
        start = time.time()
        sigma = get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=rate,
                                     accountant=accountant, epsilon_tolerance=tol, **length)
        key = f"{accountant}_tol{tol:g}"
        row[f"{key}_sigma"] = sigma
        row[f"{key}_epsilon"] = _epsilon_at(accountant, sigma, rate, steps, delta)
        print(key, row, f"{time.time() - start:.1f} s", flush=True)
    rows.append(row)
  OUT.write_text(json.dumps({"opacus": opacus.__version__, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
  main()
