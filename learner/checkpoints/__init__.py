"""echo.learner.checkpoints: the learner's checkpoints on disk, one folder per version under
``<job dir>/checkpoints``, which a restarted learner resumes from and ``echo-job export`` reads.

:mod:`~echo.learner.checkpoints.checkpoint_files` holds what every checkpoint shares (the
version folders, the newest kept, :class:`~echo.learner.checkpoints.checkpoint_files.Checkpoint`,
the fsyncs); :mod:`~echo.learner.checkpoints.checkpoint` writes the single learner's and reads any
whole; :mod:`~echo.learner.checkpoints.dcp_checkpoint` writes and reads the FSDP2 learner's
sharded ones (``torch.distributed.checkpoint``).
"""
