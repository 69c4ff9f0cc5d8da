"""Running a daemon until SIGINT/SIGTERM, then shutting down cleanly.

:func:`run_until_signalled` owns one nursery: the daemon's main coroutine and a signal watcher.
The first SIGINT or SIGTERM cancels the nursery, so every task unwinds through its ``finally``
blocks (hosts close, subprocesses are terminated) and the call returns ``True``; no
KeyboardInterrupt traceback reaches the volunteer or operator. An error from a single task
is re-raised on its own, outside the nurseries' exception groups.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
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
    vanishes without a word.

    What the daemon built before this call is kept out of every later garbage collection
    (:func:`settle_heap`), and its process exits without a last full one (:func:`fast_exit`)."""
    faulthandler.enable()
    fast_exit()
    settle_heap()
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


def fast_exit() -> None:
    """Freeze the garbage collector's objects as the interpreter exits (an atexit handler,
    registered once). Its teardown ends with a full collection that walks every object still
    alive, and a daemon that imported torch, transformers and libp2p has some 440,000: 3-6 s of
    CPU on a loaded 2-core machine for each node, learner and coordinator a swarm stops (which
    is how long SIGINT took them to exit, in "Garbage-collecting" with no Python frame left),
    against 0.4-1.0 s frozen. Nothing is lost: the other atexit handlers (logging's flush) run
    as before, objects are still freed by reference counting, and the memory goes back to the
    system with the process."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)


def settle_heap() -> None:
    """Collect once, then move every object alive to the collector's permanent generation
    (``gc.freeze``), so that later full collections walk only what was made since.

    A daemon's imports (torch, transformers, libp2p) leave some 440,000 tracked objects that
    live as long as it does, and each full collection walked all of them while the trio loop
    waited: 0.1-0.7 s per collection in the coordinator of ``benchmarks/attack.py`` (up to 1.0 s
    in its learner and nodes), each one an honest RPC's tail, since every request and every
    stranger's connection allocates. Call it again after building something big and lasting (a
    model, an engine) and after dropping one (a node's engine at a job's end). Frozen objects are
    still freed by reference counting, but a frozen cycle is never collected: each call first
    thaws what earlier calls froze, so that whatever of it died since (a closed engine's cycles,
    which hold its weights) is collected now rather than kept until exit."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def exception_leaves(group: BaseExceptionGroup) -> Iterator[BaseException]:
    """The exceptions of ``group`` and of every group nested in it, depth first."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from exception_leaves(exc)
        else:
            yield exc
