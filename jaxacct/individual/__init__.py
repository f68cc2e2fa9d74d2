"""Individual (per-example) privacy accounting on the device.

* ``gdp_filter`` / ``rdp_filter``: each example keeps its own budget and leaves training when it
  is spent (Koskela, Tobaben and Honkela 2023; Feldman and Zrnic 2021), as Optax-style
  ``init``/``update`` pure functions over a small pytree state, updated inside a compiled step.
* ``spent_mu`` and each filter's ``odometer``: what every example has spent so far.
* ``bucket_counter``: per-example DP-SGD accounting (Koskela et al., Sec. 5): noise ratios
  counted on a grid in the step, per-example PLD / GDP / RDP epsilons afterwards.

What the figures certify (``FILTER_CERTIFIES``, ``COUNTER_CERTIFIES``): a filter's guarantee
holds under full adaptivity; a bucket counter's per-example epsilon certifies the example's
realised gradient norms as if they had been fixed in advance.
"""

from jaxacct.individual._grid import noise_grid
from jaxacct.individual.dpsgd import CERTIFIES as COUNTER_CERTIFIES
from jaxacct.individual.dpsgd import (BucketCounter, BucketState, PerExample, bucket_counter,
                                      per_example_privacy)
from jaxacct.individual.filters import CERTIFIES as FILTER_CERTIFIES
from jaxacct.individual.filters import (DEFAULT_ORDERS, DEFAULT_RTOL, FilterState,
                                        IndividualFilter, first_copies, gdp_filter, rdp_budget,
                                        rdp_epsilon, rdp_filter, spent_mu)

__all__ = ["BucketCounter", "BucketState", "COUNTER_CERTIFIES", "DEFAULT_ORDERS", "DEFAULT_RTOL",
           "FILTER_CERTIFIES", "FilterState", "IndividualFilter", "PerExample", "bucket_counter",
           "first_copies", "gdp_filter", "noise_grid", "per_example_privacy", "rdp_budget",
           "rdp_epsilon", "rdp_filter", "spent_mu"]
