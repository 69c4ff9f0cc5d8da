"""The network emulator (tools/netem.py): shaped links between namespaces, shared fairly.

Needs root, iproute2 and network namespaces; skipped where the machine lacks them.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import echo.tools.netem as netem

PREFIX = "echt"
SUBNET = "10.75.0.0/24"
SEND_S = 4.0
UP_BPS = 1e6

_OK, _WHY = netem.available(prefix="echq")
needs_netns = pytest.mark.skipif(not _OK, reason=f"network namespaces unavailable: {_WHY}")

# Receivers count what arrives in a window of SEND_S seconds that opens WARMUP_S after the
# sender starts (monotonic clock, shared by every namespace), then hang up; the sender keeps
# every connection full until its peers hang up.
WARMUP_S = 1.0
RECEIVER = """
import socket, sys, time
opens = float(sys.argv[1]); closes = opens + float(sys.argv[2])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 5001)); srv.listen(8); srv.settimeout(30)
conn, _ = srv.accept(); conn.settimeout(1.0)
total = 0
while time.monotonic() < closes:
    try:
        data = conn.recv(1 << 16)
    except TimeoutError:
        continue
    if not data:
        break
    if time.monotonic() >= opens:
        total += len(data)
print(total, flush=True)
"""

SENDER = """
import selectors, socket, sys, time
until = float(sys.argv[1])
sel = selectors.DefaultSelector()
for ip in sys.argv[2:]:
    c = socket.create_connection((ip, 5001), timeout=10)
    c.setblocking(False)
    sel.register(c, selectors.EVENT_WRITE)
block = b"x" * (1 << 16)
while sel.get_map() and time.monotonic() < until:
    for key, _ in sel.select(timeout=0.1):
        try:
            key.fileobj.send(block)
        except BlockingIOError:
            pass
        except OSError:  # the receiver's window closed
            sel.unregister(key.fileobj)
            key.fileobj.close()
"""


def _share(shaper: str, receivers: int) -> list[int]:
    """Bytes each of ``receivers`` hosts got in SEND_S seconds from one host uploading to all of
    them at once."""
    hosts = [netem.HostSpec("up", UP_BPS, 50e6)] + [
        netem.HostSpec(f"r{i}", 50e6, 50e6) for i in range(receivers)]
    infos = netem.up(hosts, prefix=PREFIX, subnet=SUBNET, quiet=True, shaper=shaper)
    try:
        opens = time.monotonic() + 1.5 + WARMUP_S
        procs = [subprocess.Popen(netem.exec_argv(f"r{i}", [sys.executable, "-c", RECEIVER,
                                                            str(opens), str(SEND_S)],
                                                  prefix=PREFIX),
                                  stdout=subprocess.PIPE, text=True)
                 for i in range(receivers)]
        time.sleep(1.0)
        subprocess.run(netem.exec_argv("up", [sys.executable, "-c", SENDER,
                                              str(opens + SEND_S + 2.0),
                                              *[i.ip for i in infos[1:]]], prefix=PREFIX),
                       check=True, timeout=60)
        return [int(p.communicate(timeout=60)[0].strip()) for p in procs]
    finally:
        netem.down(PREFIX, quiet=True)


@pytest.mark.slow
@needs_netns
def test_fair_queueing_shares_an_uplink_evenly():
    got = _share("htb-fq", 8)  # one shared FIFO gives these flows 0.35-1.0x of each other
    total = sum(got)
    # The link is shaped and used (headers take ~5%), and no flow is starved.
    assert 0.8 * UP_BPS * SEND_S <= total <= 1.05 * UP_BPS * SEND_S, got
    assert min(got) >= 0.75 * max(got), got


@needs_netns
def test_bad_shaper_is_refused_and_leaves_nothing():
    with pytest.raises(ValueError, match="shaper"):
        netem.up([netem.HostSpec("a", 1e6, 1e6)], prefix=PREFIX, subnet=SUBNET, shaper="fifo")
    assert not netem.load(PREFIX)
