"""Benchmarks of the hot paths, each run as a script: ``python benchmarks/<name>.py [--quick]``.

Each prints ratios against a baseline measured in the same run, and its last line is one JSON
object of the figures. The tests import a few of their pure helpers (``benchmarks.learning``,
``benchmarks.stability``) from here."""
