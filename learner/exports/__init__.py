"""echo.learner.exports: a published version written out as a folder, for ``echo-job export``.

:mod:`~echo.learner.exports.export` writes a version as a Hugging Face model folder (the weights
every node received, bit for bit); :mod:`~echo.learner.exports.lora_merge` writes a LoRA job's
version with its adapter merged into the base (the adapter alone is
:func:`echo.learner.lora.export_adapter`'s); :mod:`~echo.learner.exports.staging` makes every
such folder appear whole or not at all.
"""
