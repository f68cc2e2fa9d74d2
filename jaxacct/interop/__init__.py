"""jaxacct where the ecosystem expects another accountant.

* ``JaxacctAccountant``: a ``dp_accounting.PrivacyAccountant`` (compose ``DpEvent``s, query
  ``get_epsilon`` / ``get_delta``) whose answers are jaxacct's certified upper bounds. Needs
  dp-accounting (``pip install "jaxacct[dp-accounting]"``).
* ``JaxacctAccountantConfig``: a jax_privacy 2.x ``DpAccountantConfig`` whose
  ``create_accountant()`` is that accountant, so jax_privacy's accounting and calibration run on
  jaxacct. Needs jax-privacy.

Each is imported on first use, so one does not need the other's library. (Events in and out of
jaxacct's compositions: ``jaxacct.from_dp_event`` and ``jaxacct.to_dp_event``.)
"""

from __future__ import annotations

import importlib

_HOMES = {"JaxacctAccountant": "jaxacct.interop.accountant",
          "JaxacctAccountantConfig": "jaxacct.interop.jax_privacy_config"}

__all__ = sorted(_HOMES)


def __getattr__(name):
  if name in _HOMES:
    return getattr(importlib.import_module(_HOMES[name]), name)
  raise AttributeError(f"module 'jaxacct.interop' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(__all__))
