"""Confinement of the current process: what a scorer of untrusted text may still touch.

:func:`confine` is called once by the scoring sandbox (:mod:`echo.tasks.sandbox_zygote`) after
it has imported and warmed everything it will need, and before it reads any completion. What it
applies, in order, each step kept only where the kernel and our privileges allow it:

1. **No network, no host filesystem.** A new network namespace (no interfaces, not even
   loopback) and a new mount namespace whose root (``chroot``) is a read-only tmpfs holding
   read-only bind mounts of the code folders (:func:`code_dirs`: the interpreter, the packages
   and this project's modules, which scorers import and read data files from lazily). No home,
   no data directory, no ``/tmp``, no ``/proc``. As root directly; as another user through an
   unprivileged user namespace.
2. **No privileges.** As root: every group dropped and the uid/gid set to ``nobody``; in a user
   namespace: every capability dropped. Then ``PR_SET_NO_NEW_PRIVS`` and not dumpable (no
   ptrace from a sibling, no core file).
3. **Resource limits** (:class:`Limits`): address space, file size 0 (a write of one byte to a
   file kills the process), open files, core size 0, and a CPU priority below the caller's.
   Per-call limits (CPU seconds, no new processes) are set by :func:`limit_call` in each
   forked child.

Which steps took is returned as a list of names (logged by the coordinator at start); a missing
step weakens the sandbox but never silently: :data:`STRONG` lists what a full one has.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import resource
import signal
import sys
import tempfile
from dataclasses import dataclass

# clone(2) flags for unshare(2).
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
# prctl(2) options.
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38
# mount(2) flags.
_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 1, 2, 4
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
# The unprivileged account of Debian and most distributions.
NOBODY_UID = NOBODY_GID = 65534
# Everything a full sandbox applies; a subset is a weaker one (see the module doc).
STRONG = ("no_network", "no_filesystem", "no_privileges", "no_new_privs", "rlimits", "low_priority")


@dataclass(frozen=True)
class Limits:
    """Resource limits of a scoring process (bytes, files, seconds)."""

    # Headroom over what the process has mapped when confined: scorers parse short answers, and
    # a hostile answer that builds a huge number or string hits this instead of the machine.
    address_space_headroom: int = 1 << 30
    # Enough for the sockets the sandbox holds; scorers open no files.
    open_files: int = 16
    # Nice steps below the process that started the sandbox. The sandbox shares that process's
    # session, so its scheduling group: the coordinator's event loop then takes the core back
    # from a scorer the moment it has work (kernel weights 1024 against 335), whatever a
    # hostile text keeps the scorer doing.
    nice: int = 5


@functools.cache
def _libc() -> ctypes.CDLL:
    # The interpreter's own symbols include libc's; find_library would run ldconfig each time.
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def jail_root() -> str:
    """An empty directory, mode 0555, to ``chroot`` into (made once per user and reused)."""
    path = os.path.join(tempfile.gettempdir(), f"echo-scorer-jail-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o555)
    st = os.lstat(path)
    # Someone else's directory, a link, or one with content is not an empty jail.
    if (
        st.st_uid != os.getuid()
        or not os.path.isdir(path)
        or os.path.islink(path)
        or os.listdir(path)
    ):
        raise OSError(f"{path} is not an empty directory of ours")
    os.chmod(path, 0o555)
    return path


def code_dirs() -> list[str]:
    """Directories the scorers may read: the interpreter's and the packages' (``sys.path``),
    and the folders of this project's loaded modules (an editable install maps them from
    outside ``sys.path``). Only folders of code and its data files; no home, no data dir."""
    found = {os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)}
    for prefix in (sys.prefix, sys.base_prefix, sys.exec_prefix):
        found.add(os.path.realpath(prefix))
    for name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None)
        if name.startswith("echo.") and path:
            found.add(os.path.realpath(os.path.dirname(path)))
    # Keep the outermost of nested folders: one bind mount covers what is below it.
    out: list[str] = []
    for d in sorted(found):
        if not out or not (d + "/").startswith(out[-1].rstrip("/") + "/"):
            out.append(d)
    return [d for d in out if d != "/"]


def _mount(
    libc: ctypes.CDLL,
    src: bytes | None,
    dst: str,
    fstype: bytes | None,
    flags: int,
    data: bytes | None = None,
) -> None:
    _check(libc.mount(src, dst.encode(), fstype, flags, data), f"mount {dst}")


def _build_root(libc: ctypes.CDLL, root: str, dirs: list[str]) -> None:
    """In this (new) mount namespace: a tmpfs at ``root`` holding read-only bind mounts of
    ``dirs`` at their own paths, the tmpfs itself made read-only last. The host sees none of
    it: ``root`` stays an empty directory there."""
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing propagates back
    _mount(libc, b"none", root, b"tmpfs", _MS_NOSUID | _MS_NODEV, b"size=1m,mode=0755")
    ro = _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
    for d in dirs:
        target = root + d
        os.makedirs(target, mode=0o755, exist_ok=True)
        _mount(libc, d.encode(), target, None, _MS_BIND | _MS_REC)
        _mount(libc, None, target, None, ro)
    _mount(libc, None, root, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _as_root(libc: ctypes.CDLL, applied: list[str]) -> None:
    dirs, root = code_dirs(), jail_root()
    _check(libc.unshare(_CLONE_NEWNET | _CLONE_NEWNS), "unshare(CLONE_NEWNET | CLONE_NEWNS)")
    applied.append("no_network")
    _build_root(libc, root, dirs)
    os.chroot(root)
    os.chdir("/")
    applied.append("no_filesystem")
    os.setgroups([])
    os.setgid(NOBODY_GID)
    os.setuid(NOBODY_UID)
    applied.append("no_privileges")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _drop_capabilities(libc: ctypes.CDLL) -> None:
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        ]

    header = Header(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (Data * 2)()  # all zero: no capability left
    _check(libc.capset(ctypes.byref(header), data), "capset")


def _in_user_namespace(libc: ctypes.CDLL, applied: list[str]) -> None:
    uid, gid = os.getuid(), os.getgid()
    dirs, root = code_dirs(), jail_root()
    _check(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET | _CLONE_NEWNS), "unshare(user, net, mnt)")
    applied.append("no_network")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"0 {uid} 1")
    _write("/proc/self/gid_map", f"0 {gid} 1")
    _build_root(libc, root, dirs)
    os.chroot(root)
    os.chdir("/")
    applied.append("no_filesystem")
    _drop_capabilities(libc)
    applied.append("no_privileges")


def confine(limits: Limits | None = None) -> list[str]:
    """Confine this process for good (see the module doc); returns the steps that took.

    Call it from a single-threaded process. Never raises for a step the system refuses: that
    step is left out of the returned list.
    """
    limits = limits or Limits()
    libc = _libc()
    applied: list[str] = []
    mapped = _mapped_bytes()  # /proc is out of reach once confined
    try:
        if os.geteuid() == 0:
            _as_root(libc, applied)
        else:
            _in_user_namespace(libc, applied)
    except OSError:
        pass  # what took is in ``applied``; the caller logs what did not
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0:
        applied.append("no_new_privs")
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (mapped + limits.address_space_headroom,) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files,) * 2)
        applied.append("rlimits")
    except (OSError, ValueError):
        pass
    with contextlib.suppress(OSError):
        os.nice(limits.nice)
        applied.append("low_priority")
    return applied


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent, ``parent_pid``, exits (set after any change of
    uid: the kernel clears it then), so no scorer outlives the process that would kill it."""
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent was gone before the setting took
        os._exit(1)


def limit_call(cpu_s: float, parent_pid: int) -> None:
    """Limits of one forked scoring child: ``cpu_s`` CPU seconds (then SIGXCPU kills it, a
    backstop under the parent's wall-clock timeout), no new processes, death with the zygote."""
    die_with_parent(parent_pid)
    seconds = max(1, int(cpu_s + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))
    # Root in the initial namespace would ignore it; the uid is nobody's by now.
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))


def _mapped_bytes() -> int:
    """This process's virtual size (``VmSize``), the base the address-space limit adds to."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")
