"""echo.learner.algorithm: the GRPO update, as math on tensors, with no I/O.

:mod:`~echo.learner.algorithm.grpo` turns groups into advantages and padded batches and takes the
optimizer steps (:class:`~echo.learner.algorithm.grpo.GRPOLearner`);
:mod:`~echo.learner.algorithm.objective` is the per-token objective a job picks (ppo or cispo);
:mod:`~echo.learner.algorithm.clip` clips gradients by a global norm that does not depend on how
they are sharded. The single learner and the FSDP2 ranks run the same code.
"""
