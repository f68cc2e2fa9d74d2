"""jaxacct: a JAX-native, differentiable differential-privacy accountant.

Quick start::

    import jaxacct
    eps = jaxacct.dpsgd_epsilon(noise_multiplier=1.0, sampling_rate=0.01, steps=10_000,
                                delta=1e-5)
    eps.lower, eps.estimate, eps.upper   # certified: lower <= true epsilon <= upper
"""

from jaxacct import calibrate, cgf, edgeworth, gdp, group, individual, pld, rdp, spa
from jaxacct.api import (ACCOUNTANTS, RELATIONS, compose, delta, dpsgd_composition, dpsgd_delta,
                         dpsgd_epsilon, dpsgd_plan, epsilon, make_plan)
from jaxacct.calibrate import get_noise_multiplier
from jaxacct.composition import Composition
from jaxacct.dp_event import from_dp_event
from jaxacct.group import group_delta, group_epsilon
from jaxacct.mixture import MixtureOfGaussians
from jaxacct.models import (EpsilonDelta, Gaussian, Laplace, PoissonSampled, PrivacyLoss, PureDP,
                            RandomizedResponse, SampledGaussianReplaceOne)
from jaxacct.pld import Plan, PrivacyLossDistribution, SizeCache
from jaxacct.results import Bounds

__version__ = "0.1.0"

__all__ = [
    "ACCOUNTANTS", "Bounds", "Composition", "EpsilonDelta", "Gaussian", "Laplace",
    "MixtureOfGaussians", "Plan", "PoissonSampled", "PrivacyLoss", "PrivacyLossDistribution",
    "PureDP", "RELATIONS", "RandomizedResponse", "SampledGaussianReplaceOne", "SizeCache",
    "compose", "delta", "dpsgd_composition", "dpsgd_delta", "dpsgd_epsilon", "dpsgd_plan",
    "epsilon", "from_dp_event", "get_noise_multiplier", "group_delta", "group_epsilon",
    "make_plan", "calibrate", "cgf", "edgeworth", "gdp", "group", "individual", "pld", "rdp",
    "spa",
]
