"""A scoring zygote outlives the thread that first scored with it (issue 26, attack benchmark).

The zygote asks to be killed when its parent dies (``PR_SET_PDEATHSIG``), and Linux sends that
signal when the parent *thread* exits. The coordinator scores in trio's worker threads, which
retire after 10 s idle: every lull killed the zygote, and the next group waited for a new one
(reasoning-gym and sympy imported and warmed again). Against the real sandbox and zygote.
"""

from __future__ import annotations

import threading
import time

from echo.tasks import make_task
from echo.tasks.sandbox import Recipe, Sandbox


def test_the_zygote_survives_the_thread_that_started_it() -> None:
    task = make_task("addition", {})
    with Sandbox(Recipe("addition", {})) as sandbox:
        first: list[float] = []
        worker = threading.Thread(
            target=lambda: first.extend(s.value for s in sandbox.score(3, [task.answer(3)]))
        )
        worker.start()
        worker.join()  # the thread that started the zygote is gone, as a retired trio worker
        assert first == [1.0]
        zygote = sandbox._zygote
        assert zygote is not None
        time.sleep(0.5)  # a parent-death signal is delivered at once; give it time all the same
        assert zygote.proc.poll() is None, f"the zygote died with its thread ({zygote.proc.poll()})"
        assert sandbox.score(4, [task.answer(4)])[0].value == 1.0
        assert sandbox.restarts == 0
        assert sandbox._zygote is zygote
