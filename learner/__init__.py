"""echo.learner: one job's learner, which trains on verified rollouts and publishes versions.

The process (``python -m echo.learner``, :mod:`~echo.learner.cli`) is :mod:`~echo.learner.service`'s
step loop, with its signed calls to the coordinator (:mod:`~echo.learner.link`), the job's lock
(:mod:`~echo.learner.fence`) and the swarm presence its versions are served from
(:mod:`~echo.learner.source`). The step's compute is :mod:`~echo.learner.trainer` (a LoRA job's:
:mod:`~echo.learner.lora`) over the re-scoring gate (the :mod:`~echo.learner.rescoring` package)
and the GRPO update (the :mod:`~echo.learner.algorithm` package), with format warm-up
(:mod:`~echo.learner.warmup`) and held-out evaluation (:mod:`~echo.learner.evaluate`); versions
are made by :mod:`~echo.learner.publish`. Checkpoints are the :mod:`~echo.learner.checkpoints`
package, exports to a folder the :mod:`~echo.learner.exports` package, and the learner on several
ranks the :mod:`~echo.learner.fsdp` package; memory estimates (:mod:`~echo.learner.memory`) and
tracking (:mod:`~echo.learner.tracking`) have a module each.
"""
