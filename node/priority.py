"""A volunteer's node yields the CPU to the machine's own work: :func:`yield_cpu`.

Volunteer computing runs below everything else on the machine it borrows (BOINC's clients run
at nice 19): a volunteer who notices their machine slowing down stops volunteering. Generation
is throughput work that loses little when it waits a few milliseconds; whatever else the machine
runs (the volunteer's programs, or a coordinator and learner on a shared host) is usually
waiting on a person or a deadline.

Two things set a process's share of a busy core on Linux:

- its threads' **nice** values, which rank it against the other processes of its own
  scheduling group; the kernel keeps a nice per thread, so every thread already running is
  lowered, and threads started later inherit it from the thread that starts them;
- its **autogroup** (``/proc/sys/kernel/sched_autogroup_enabled``), which groups every process of
  one session and weighs that group as one nice-0 task against the others, whatever its
  processes' nice. A node that leads its own session (started by a service manager or a
  supervisor with ``setsid``) lowers its autogroup too; one started from a shell shares the
  shell's session, whose autogroup it leaves alone (it is the volunteer's terminal, not ours).

Only ever lowers: an unprivileged process cannot raise its priority back, and a node started
``nice -n 19`` stays there.
"""

from __future__ import annotations

import os
from pathlib import Path

# Ten steps of nice: under contention a nice-10 task gets about a tenth of the CPU a nice-0 one
# gets (kernel weights 110 and 1024), enough that the node still works on a busy machine, little
# enough that the machine's owner does not feel it. BOINC's 19 (weight 15) would all but stop
# a node on a machine that is never idle.
DEFAULT_NICE = 10
AUTOGROUP_ENABLED = Path("/proc/sys/kernel/sched_autogroup_enabled")
AUTOGROUP = Path("/proc/self/autogroup")


def yield_cpu(nice: int) -> list[str]:
    """Lower this process's threads to ``nice`` and, where it leads its session under
    autogroups, its session's group too; never raises a priority. Returns what was lowered
    (``"threads"``, ``"autogroup"``), empty when nothing was: ``nice`` is 0, the platform has no
    ``setpriority``, or everything already ran at ``nice`` or lower. OS errors (a thread that
    exited meanwhile, a kernel without autogroups) are skipped, never raised: a node that cannot
    lower its priority still runs.
    """
    done: list[str] = []
    if nice <= 0 or not hasattr(os, "setpriority"):
        return done
    if _lower_threads(nice):
        done.append("threads")
    if lower_session_group(nice):
        done.append("autogroup")
    return done


def _lower_threads(nice: int) -> bool:
    task_dir = Path("/proc/self/task")
    tids = [int(t) for t in os.listdir(task_dir)] if task_dir.is_dir() else [0]
    lowered = False
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                lowered = True
        except OSError:  # the thread ended between the listing and the call
            continue
    return lowered


def session_group_nice() -> int | None:
    """The nice value of this process's autogroup; ``None`` where it has none: autogroups off
    or missing, or the process still in the kernel's default group (no ``setsid`` since boot
    in its ancestry, as in some containers), whose file reads empty."""
    try:
        if AUTOGROUP_ENABLED.read_text().strip() != "1":
            return None
        # "/autogroup-123 nice 0", or "" in the default group
        words = AUTOGROUP.read_text().split()
        return int(words[-1]) if len(words) == 3 and words[1] == "nice" else None
    except (OSError, ValueError):
        return None


def lower_session_group(nice: int) -> bool:
    """Lower this process's session's autogroup to ``nice``, where autogroups are on and this
    process leads its session (never another's, never raising it); whether it was lowered."""
    if os.getsid(0) != os.getpid():
        return False
    now = session_group_nice()
    if now is None or now >= nice:
        return False
    try:
        AUTOGROUP.write_text(str(nice))
    except OSError:
        return False
    return True
