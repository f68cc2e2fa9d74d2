"""jaxacct: a JAX-native, differentiable differential-privacy accountant.

Quick start::

    import jaxacct
    eps = jaxacct.dpsgd_epsilon(noise_multiplier=1.0, sampling_rate=0.01, steps=10_000,
                                delta=1e-5)
    eps.lower, eps.estimate, eps.upper   # certified: lower <= true epsilon <= upper

The names below are imported on first use (PEP 562), so ``import jaxacct`` (and the command
line's ``--help``) does not import JAX; each module imports what its numerics need.
"""

import importlib

__version__ = "0.1.0"

# Each public name and the module that defines it (a submodule: itself).
_EXPORTS = {
    **dict.fromkeys(("ACCOUNTANTS", "RELATIONS", "compose", "delta", "dpsgd_composition",
                     "dpsgd_delta", "dpsgd_epsilon", "dpsgd_plan", "epsilon", "make_plan"),
                    "jaxacct.api"),
    "get_noise_multiplier": "jaxacct.calibrate",
    "Composition": "jaxacct.composition",
    "from_dp_event": "jaxacct.dp_event",
    "to_dp_event": "jaxacct.dp_event",
    "group_delta": "jaxacct.group",
    "group_epsilon": "jaxacct.group",
    "MixtureOfGaussians": "jaxacct.mixture",
    **dict.fromkeys(("EpsilonDelta", "Gaussian", "Laplace", "PoissonSampled", "PrivacyLoss",
                     "PureDP", "RandomizedResponse", "SampledGaussianReplaceOne"),
                    "jaxacct.models"),
    **dict.fromkeys(("Plan", "PrivacyLossDistribution", "SizeCache"), "jaxacct.pld"),
    "Bounds": "jaxacct.results",
    **{name: f"jaxacct.{name}" for name in ("calibrate", "cgf", "compile_cache", "edgeworth",
                                             "gdp", "group", "individual", "interop", "pld",
                                             "rdp", "spa", "training")},
}

__all__ = [
    "ACCOUNTANTS", "Bounds", "Composition", "EpsilonDelta", "Gaussian", "Laplace",
    "MixtureOfGaussians", "Plan", "PoissonSampled", "PrivacyLoss", "PrivacyLossDistribution",
    "PureDP", "RELATIONS", "RandomizedResponse", "SampledGaussianReplaceOne", "SizeCache",
    "compose", "delta", "dpsgd_composition", "dpsgd_delta", "dpsgd_epsilon", "dpsgd_plan",
    "epsilon", "from_dp_event", "get_noise_multiplier", "group_delta", "group_epsilon",
    "make_plan", "to_dp_event", "calibrate", "cgf", "compile_cache", "edgeworth", "gdp", "group",
    "individual", "interop", "pld", "rdp", "spa", "training",
]


def __getattr__(name):
  """A public name imported from its module on first use (then kept here); any other submodule
  (``jaxacct.api``, ``jaxacct.results``, ...) imported on first use as well."""
  module = _EXPORTS.get(name)
  if module == f"{__name__}.{name}":
    value = importlib.import_module(module)
  elif module is not None:
    value = getattr(importlib.import_module(module), name)
  elif name.startswith("__"):
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  else:
    try:
      value = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
      if error.name != f"{__name__}.{name}":
        raise
      raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))
