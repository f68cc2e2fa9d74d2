"""The PLD accountant: grid discretisation of each step's privacy loss, FFT composition, queries.

Method (a certified variant of the PRV accountant of Gopi, Lee and Wutschitz, "Numerical
composition of differential privacy", NeurIPS 2021):

* **Connect-the-dots discretisation** (``discretise``). Each step's loss L, restricted to a cell
  [a, b] of the grid h*Z, is split between a and b so that E[e^{-D}] = E[e^{-L}] in the cell. The
  discrete pair dominates the true one (g(y) = (1 - e^{eps-y})_+ is convex in e^{-y}), so delta
  computed from the composition of the discrete steps is an *upper* bound for any number of
  steps, with a bias of only ~T h^2/8 (no mean-shift quadrature, whose error would grow like T).
* **Composition** (``spectrum``). Spectra raised to the counts and multiplied, the low band
  computed directly, every round-off bounded; the composed pmf read from a window placed by a
  Chernoff bound.
* **Queries** (``query``). Each grid mass is spread over its cell, so delta(eps) is C^1 in eps and
  in every parameter; epsilon(delta) is its inverse with implicit gradients. The lower bound
  comes from the split's coupling (Hoeffding).
* **Plans** (``plan``). Grid sizes are static (an accuracy ``Plan`` made on the host); the grid
  step, windows and all parameters are arrays, so one compiled function serves a sweep.

``accountant`` is the front door: ``epsilon``, ``delta``, ``compose`` and ``make_plan``.
"""

from jaxacct.pld.accountant import compose, delta, epsilon, make_plan
from jaxacct.pld.distribution import PrivacyLossDistribution
from jaxacct.pld.plan import Plan, SizeCache

__all__ = ["Plan", "PrivacyLossDistribution", "SizeCache", "compose", "delta", "epsilon",
           "make_plan"]
