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


def test_a_node_learns_of_a_version_from_its_lease_reply_alone() -> None:
    """The worker syncs to the version a lease reply names and to nothing else; the follower
    syncs on its own to nothing (a gossiped plan only carries chunks). That the one route
    suffices when no plan ever arrives is tests/e2e/test_e2e.py's
    ``test_nodes_that_hear_no_plan_follow_every_version_through_their_lease_replies``."""
    import echo.node.policy as policy
    import echo.node.worker as worker

    def sync_calls(module) -> list[str]:
        return [
            ast.unparse(call.args[0])
            for call in ast.walk(ast.parse(inspect.getsource(module)))
            if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "sync_to"
        ]

    import echo.node.base_group as base_group

    assert sync_calls(worker) == ["reply.current_version"]
    # A job sharing the base of the node's job (issue 28) syncs through its turns, to what a
    # lease reply of that job names; inside, to that same target.
    turns = [
        ast.unparse(call.args[1])
        for call in ast.walk(ast.parse(inspect.getsource(worker)))
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "sync"
    ]
    assert turns == ["reply.current_version"]
    assert sync_calls(base_group) == ["target", "target"]
    # The follower's only call is its weight sync's, inside sync_to itself, to the same target.
    assert sync_calls(policy) == ["target"]
    assert "announced" not in inspect.getsource(policy) + inspect.getsource(worker)
