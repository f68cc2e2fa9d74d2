"""jax_privacy 2.x accounting on jaxacct: a ``DpAccountantConfig`` of ``JaxacctAccountant``.

jax_privacy's training accountants (``DpsgdTrainingAccountant``, ...) and its calibration
(``calibrate_noise_multiplier``, ``calibrate_num_updates``, ``calibrate_batch_size``) take a
``DpAccountantConfig`` and call its ``create_accountant()``; with this one their every epsilon is
jaxacct's certified upper bound::

    from jax_privacy import accounting
    from jaxacct.interop import JaxacctAccountantConfig

    training = accounting.DpsgdTrainingAccountant(JaxacctAccountantConfig())  # one line changed
    sigma = accounting.calibrate_noise_multiplier(
        target_epsilon=2.0, accountant=training, batch_sizes=256, num_updates=1000,
        num_samples=60_000, target_delta=1e-5)

jax_privacy composes under add-or-remove adjacency (as its own configs do).
"""

from __future__ import annotations

import dataclasses

from jax_privacy.accounting import DpAccountantConfig

from jaxacct.interop.accountant import JaxacctAccountant


@dataclasses.dataclass(kw_only=True, frozen=True)
class JaxacctAccountantConfig(DpAccountantConfig):
  """jax_privacy's accountant configuration for jaxacct: ``accountant`` ("pld" by default,
  "rdp", "spa", "edgeworth") and the PLD accountant's ``eps_error`` (None: its default, 0.01),
  as in ``JaxacctAccountant``."""

  accountant: str = "pld"
  eps_error: float | None = None

  def __post_init__(self):
    self.create_accountant()  # (refuses a bad accountant or eps_error here, not mid-training)

  def create_accountant(self) -> JaxacctAccountant:
    """A new ``JaxacctAccountant`` (empty ledger), add-or-remove adjacency."""
    return JaxacctAccountant(accountant=self.accountant, eps_error=self.eps_error)
