"""Running a daemon until SIGINT/SIGTERM, then shutting down cleanly.

:func:`run_until_signalled` owns one nursery: the daemon's main coroutine and a signal watcher.
The first SIGINT or SIGTERM cancels the nursery, so every task unwinds through its ``finally``
blocks (hosts close, subprocesses are terminated) and the call returns ``True``; no
KeyboardInterrupt traceback reaches the volunteer or operator. An error from a single task
is re-raised on its own, outside the nurseries' exception groups.
"""

from __future__ import annotations

import faulthandler
import signal
from collections.abc import Awaitable, Callable, Iterator

import trio


async def _watch(scope: trio.CancelScope, fired: list[int]) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            fired.append(signum)
            scope.cancel()
            return


def run_until_signalled(main: Callable[[], Awaitable[None]]) -> bool:
    """``trio.run`` ``main`` until it returns or a stop signal arrives; True if signalled.

    A crash below Python (a segfault in an extension) prints the threads' Python stacks to
    stderr first (:mod:`faulthandler`), where the daemon's log is: without it the process
    vanishes without a word."""
    faulthandler.enable()
    fired: list[int] = []

    async def runner() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch, nursery.cancel_scope, fired)
            await main()
            nursery.cancel_scope.cancel()

    try:
        trio.run(runner)
    except BaseExceptionGroup as group:
        # Nurseries wrap errors in groups; a daemon that failed for one reason (NodeError, a
        # bad config) should surface that one error to its CLI, which prints it plainly.
        leaves = list(exception_leaves(group))
        if len(leaves) == 1:
            raise leaves[0] from None
        raise
    return bool(fired)


def exception_leaves(group: BaseExceptionGroup) -> Iterator[BaseException]:
    """The exceptions of ``group`` and of every group nested in it, depth first."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from exception_leaves(exc)
        else:
            yield exc
