"""The node's volunteer-facing failure: what stops a node, worded for the person running it."""

from __future__ import annotations


class NodeError(RuntimeError):
    """A failure the volunteer can act on; the CLI prints it without a traceback."""


class JobGone(Exception):
    """The coordinator no longer lists the job the node works for (it ended, failed or was
    paused): the node goes back to waiting for one. Not the volunteer's to act on."""
