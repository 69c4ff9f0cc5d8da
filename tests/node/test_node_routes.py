"""How facts reach a node, each by one route (issue 29): the weight sync learns what broadcasts
carry through the follower's public interface, never by reaching into its relay."""

from __future__ import annotations

import ast
import inspect

import echo.node.weights as weights
from echo.node.policy import PolicyFollower


def test_weight_sync_asks_the_follower_not_its_relay() -> None:
    tree = ast.parse(inspect.getsource(weights))
    modules = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not [mod for mod in modules if mod.startswith("echo.p2p.relay")]
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not attrs & {"relay", "transfers", "transfer"}
    # The follower answers the interface the sync reads (weights.Broadcasts).
    wanted = {
        name
        for name, member in vars(weights.Broadcasts).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }
    assert wanted == {"carried_manifest", "carried_versions"}
    for name in wanted:
        assert inspect.signature(getattr(PolicyFollower, name)).parameters.keys() == (
            inspect.signature(getattr(weights.Broadcasts, name)).parameters.keys()
        )
