"""Individual (per-example) privacy accounting on the device.

* ``gdp_filter`` / ``rdp_filter``: each example keeps its own budget and leaves training when it
  is spent (Koskela, Tobaben and Honkela 2023; Feldman and Zrnic 2021), as Optax-style
  ``init``/``update`` pure functions over a small pytree state, updated inside a compiled step.
* ``spent_mu`` and each filter's ``odometer``: what every example has spent so far.
* ``bucket_counter``: per-example DP-SGD accounting (Koskela et al., Sec. 5): noise ratios
  counted on a grid in the step, per-example PLD / GDP / RDP epsilons afterwards.
"""

from jaxacct.individual._grid import noise_grid
from jaxacct.individual.dpsgd import (BucketCounter, BucketState, PerExample, bucket_counter,
                                      per_example_privacy)
from jaxacct.individual.filters import (DEFAULT_ORDERS, FilterState, IndividualFilter, gdp_filter,
                                        rdp_budget, rdp_epsilon, rdp_filter, spent_mu)

__all__ = ["BucketCounter", "BucketState", "DEFAULT_ORDERS", "FilterState", "IndividualFilter",
           "PerExample", "bucket_counter", "gdp_filter", "noise_grid", "per_example_privacy",
           "rdp_budget", "rdp_epsilon", "rdp_filter", "spent_mu"]
