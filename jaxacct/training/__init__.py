"""DP training in JAX with the accounting inside the compiled step.

* ``DPConfig``: one configuration that yields both the batch sampler (Poisson with a fixed-shape
  buffer and validity mask, fixed-size without replacement, full batch) and the ``Composition``
  that accounts it.
* ``private_trainer(config, loss, optimizer, mesh=None)``: pure ``init`` / ``step`` functions of
  a DP-SGD / DP-GD step (per-example clipping, microbatches, Gaussian noise, an Optax optimiser,
  the privacy ledger and a per-example filter or bucket counter), one ``jit``; on a device mesh
  the examples are split over its data axis (``mesh``); ``sample`` / ``step_on_batch`` for data
  gathered by the caller from the host.
* ``calibrate(config, target_epsilon)``: the config with the noise multiplier at which its own
  sampler and accountant certify the target.
* ``privacy_report(state)``: worst-case certified epsilon, individual epsilons, active examples
  (``accounting``: the host-side accounting, on the CPU backend unless a device is asked for).
* ``save_checkpoint`` / ``restore_checkpoint``: the train state with its ledger, by Orbax; a
  restore into a run of another configuration is refused. ``checkpoint_report(directory)``: a
  saved run's privacy report without the model code (``jaxacct report``).
* ``gradients``: the building blocks (per-example gradients, clipping, noise, an Optax
  ``private_aggregate`` for per-example gradients you compute yourself, ``nnx_loss``).
"""

from jaxacct.training import accounting, gradients, mesh
from jaxacct.training.accounting import (PrivacyReport, planned_epsilon, privacy_report,
                                         worst_case_epsilon)
from jaxacct.training.calibration import calibrate
from jaxacct.training.checkpoint import checkpoint_report, restore_checkpoint, save_checkpoint
from jaxacct.training.gradients import nnx_loss, private_aggregate
from jaxacct.training.sampling import Batch, DPConfig
from jaxacct.training.step import Ledger, PrivateTrainer, StepMetrics, TrainState, private_trainer

__all__ = ["Batch", "DPConfig", "Ledger", "PrivacyReport", "PrivateTrainer", "StepMetrics",
           "TrainState", "accounting", "calibrate", "checkpoint_report", "gradients", "mesh",
           "nnx_loss", "planned_epsilon", "private_aggregate", "private_trainer",
           "privacy_report", "restore_checkpoint", "save_checkpoint", "worst_case_epsilon"]
