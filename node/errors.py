"""The node's volunteer-facing failure: what stops a node, worded for the person running it."""

from __future__ import annotations


class NodeError(RuntimeError):
    """A failure the volunteer can act on; the CLI prints it without a traceback."""
