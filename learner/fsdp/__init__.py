"""echo.learner.fsdp: the learner on several ranks, under ``torchrun`` with FSDP2.

:mod:`~echo.learner.fsdp.distributed` sets up the process group and shards a model per decoder
layer; :mod:`~echo.learner.fsdp.trainer` runs the single learner's step on every rank over its
share of the batch (and re-scores its share of the groups); :mod:`~echo.learner.fsdp.lora` does
the same for a LoRA job, training the adapter alone; :mod:`~echo.learner.fsdp.ranks` makes rank 0
the learner the coordinator knows and the other ranks its followers. Checkpoints are
:mod:`echo.learner.checkpoints.dcp_checkpoint`'s, which the single learner reads too.
"""
