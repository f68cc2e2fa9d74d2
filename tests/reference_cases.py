"""Builds jaxacct compositions for the rows of tests/data/references.json."""

import json
import pathlib

import jaxacct

REFERENCES = json.loads((pathlib.Path(__file__).parent / "data" / "references.json").read_text())


def composition(row):
  entries = []
  for sigma, rate, count in row["entries"]:
    if row["relation"] == "replace_one":
      model = (jaxacct.Gaussian(sigma, 2.0) if rate == 1.0
               else jaxacct.SampledGaussianReplaceOne(sigma, rate))
    else:
      model = jaxacct.Gaussian(sigma) if rate == 1.0 else jaxacct.PoissonSampled(
          jaxacct.Gaussian(sigma), rate)
    entries.append((model, int(count)))
  return jaxacct.Composition.of(*entries)


def label(row):
  parts = ["+".join(f"s{s:.3g}q{q:.3g}T{int(c)}" for s, q, c in row["entries"]),
           f"d{row['delta']:.1e}", row["relation"]]
  return "-".join(parts)
