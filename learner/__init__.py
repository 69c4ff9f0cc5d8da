"""echo.learner: one job's learner, which trains on verified rollouts and publishes versions.

The process (``python -m echo.learner``, :mod:`~echo.learner.cli`) is :mod:`~echo.learner.service`'s
step loop, with its signed calls to the coordinator (:mod:`~echo.learner.link`) and the swarm
presence its versions are served from (:mod:`~echo.learner.source`). The step's compute is
:mod:`~echo.learner.trainer` over GRPO (:mod:`~echo.learner.grpo`) and re-scoring
(:mod:`~echo.learner.rescore`, :mod:`~echo.learner.prefill`); versions are made by
:mod:`~echo.learner.publish`; checkpoints, LoRA adapters, evaluation, warm-up, export, memory
estimates and tracking have a module each; the learner on several ranks is the
:mod:`~echo.learner.fsdp` package.
"""
