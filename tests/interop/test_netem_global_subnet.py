"""netem_nat's guard on the public range (the DCUtR interop test needs a global one): a global
range is refused unless ``global_subnet=True`` asks for it, before anything is built."""

from __future__ import annotations

import pytest

import echo.tools.netem_nat as netem_nat


def test_a_global_public_range_is_refused_unless_asked_for() -> None:
    with pytest.raises(ValueError, match="100.200.0.0/24 is not a private range"):
        netem_nat.up([], [netem_nat.NatHostSpec("a")], prefix="ecjg",
                     public_subnet="100.200.0.0/24", quiet=True)
    assert netem_nat.load("ecjg") is None  # nothing was built
