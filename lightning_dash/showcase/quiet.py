"""Quieter output for the example scripts: a few narrow filters for third-party noise,
and the progress bar only on a terminal.

Only the examples call :func:`quiet_third_party_output` (in their ``main``); importing
``lightning_dash`` filters nothing. Every filter matches one known message by its text
and its category (and, for warnings, the module that raises it), so a warning from the
user's code, or another warning from the same libraries, still shows.
"""

from __future__ import annotations

import logging
import sys
import warnings

#: Lightning's rank-zero info messages go through one of these loggers: ``rank_zero_info`` (in
#: ``lightning_utilities.core.rank_zero``) logs to the one its importer set last, and importing
#: ``lightning_dash`` imports the standalone ``pytorch_lightning`` too. All are covered, so the
#: order of imports does not matter.
LIGHTNING_INFO_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "pytorch_lightning.utilities.rank_zero",
    "lightning_fabric.utilities.rank_zero",
    "lightning_utilities.core.rank_zero",
)

#: Starts of Lightning info messages that are advertisements, not information about the run.
#: Both come from ``lightning.pytorch.trainer.connectors``: ``logger_connector.py`` ("try installing
#: litlogger", printed by every ``Trainer`` that has no ``LitLogger``) and ``callback_connector.py``
#: ("try installing litmodels", printed by every ``Trainer`` with checkpointing and no ``LitModelCheckpoint``).
#: The device lines ("GPU available: False, used: False") and the others stay: they describe the run.
LIGHTNING_TIPS = ("💡 Tip: For seamless cloud logging and experiment tracking,", "💡 Tip: For seamless cloud uploads")


class _DropLightningTips(logging.Filter):
    """Drops the records of :data:`LIGHTNING_TIPS` (INFO level, exact message starts) and nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO and str(record.msg).startswith(LIGHTNING_TIPS))


def quiet_third_party_output() -> None:
    """Install the filters below in this process (idempotent)."""
    # torch (2.13 here) deprecates ``torch.utils._pytree.LeafSpec`` (FutureWarning from its constructor), and
    # Lightning 2.6's own copy of ``tree_flatten`` (lightning/pytorch/utilities/_pytree.py, used to move
    # batches and logged values) still constructs one. It is Lightning's to fix, nothing the user calls.
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
    # Lightning's data connector (``_worker_check`` in lightning/pytorch/trainer/connectors/data_connector.py)
    # suggests ``num_workers`` for DataLoaders with fewer than 2 workers on machines with more than 2 cores.
    # The examples' windows are slices of a tensor already in memory: worker processes would only add start-up
    # time. (Matched for the examples' loaders only: 'train_dataloader' and 'val_dataloader'.)
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    warnings.filterwarnings(
        "ignore",
        message=r"The '(train|val)_dataloader' does not have many workers which may be a bottleneck",
        category=PossibleUserWarning,
        module=r"lightning\.pytorch\.trainer\.connectors\.data_connector",
    )
    for name in LIGHTNING_INFO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _DropLightningTips) for existing in logger.filters):
            logger.addFilter(_DropLightningTips())


def progress_bar_wanted(flag: bool | None) -> bool:
    """``--progress-bar`` / ``--no-progress-bar`` if given, else on only when stdout is a terminal
    (a progress bar redrawn into a file or a pipe is hundreds of lines of noise)."""
    return sys.stdout.isatty() if flag is None else flag
