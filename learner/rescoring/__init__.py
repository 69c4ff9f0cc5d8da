"""echo.learner.rescoring: re-scoring submitted rollouts under the version they claim
(verification step 5), the gate a group passes before the learner trains on it.

:mod:`~echo.learner.rescoring.rescore` recomputes each token's log-prob and entropy and judges the
group (:class:`~echo.learner.rescoring.rescore.Rescorer`); :mod:`~echo.learner.rescoring.prefill`
is its prefill, each group's prompt computed once.
"""
