"""DP training in JAX with the accounting inside the compiled step.

* ``DPConfig``: one configuration that yields both the batch sampler (Poisson with a fixed-shape
  buffer and validity mask, fixed-size without replacement, full batch) and the ``Composition``
  that accounts it.
* ``private_trainer(config, loss, optimizer)``: pure ``init`` / ``step`` functions of a DP-SGD /
  DP-GD step (per-example clipping, microbatches, Gaussian noise, an Optax optimiser, the privacy
  ledger and a per-example filter or bucket counter), one ``jit``.
* ``calibrate(config, target_epsilon)``: the config with the noise multiplier at which its own
  sampler and accountant certify the target.
* ``privacy_report(state)``: worst-case certified epsilon, individual epsilons, active examples.
* ``save_checkpoint`` / ``restore_checkpoint``: the train state with its ledger, by Orbax; a
  restore into a run of another configuration is refused.
* ``gradients``: the building blocks (per-example gradients, clipping, noise, an Optax
  ``private_aggregate`` for per-example gradients you compute yourself, ``nnx_loss``).
"""

from jaxacct.training import gradients
from jaxacct.training.calibration import calibrate
from jaxacct.training.checkpoint import restore_checkpoint, save_checkpoint
from jaxacct.training.gradients import nnx_loss, private_aggregate
from jaxacct.training.sampling import Batch, DPConfig
from jaxacct.training.step import (Ledger, PrivacyReport, PrivateTrainer, StepMetrics, TrainState,
                                   planned_epsilon, private_trainer, privacy_report,
                                   worst_case_epsilon)

__all__ = ["Batch", "DPConfig", "Ledger", "PrivacyReport", "PrivateTrainer", "StepMetrics",
           "TrainState", "calibrate", "gradients", "nnx_loss", "planned_epsilon",
           "private_aggregate", "private_trainer", "privacy_report", "restore_checkpoint",
           "save_checkpoint", "worst_case_epsilon"]
