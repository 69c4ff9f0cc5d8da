"""The console filter for py-libp2p's "peer went away" errors drops those and nothing else."""

from __future__ import annotations

import importlib
import inspect
import logging

import pytest

from echo.p2p.log_noise import GONE_PEER, quiet_libp2p


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def captured():
    # py-libp2p's "libp2p" logger does not propagate to the root (without a handler its
    # records reach stderr through logging's last resort): capture at that logger.
    top = logging.getLogger("libp2p")
    handler = Capture()
    top.addHandler(handler)
    saved = {n: (logging.getLogger(n).level, list(logging.getLogger(n).filters))
             for n in ("libp2p", "multiaddr", "async_service", *GONE_PEER)}
    yield handler
    top.removeHandler(handler)
    for n, (level, filters) in saved.items():
        log = logging.getLogger(n)
        log.setLevel(level)
        log.filters[:] = filters


def test_the_filtered_messages_are_what_this_py_libp2p_logs():
    # A py-libp2p upgrade that renames a module or rewords a message must fail here, not
    # quietly bring the noise back.
    for name, starts in GONE_PEER.items():
        module = importlib.import_module(name)
        assert module.logger.name == name
        source = inspect.getsource(module)
        for start in starts:
            assert start.split(" for peer")[0].split(":")[0] in source, (name, start)


def test_gone_peer_errors_are_dropped_and_other_errors_kept(captured):
    quiet_libp2p(logging.ERROR)
    host = logging.getLogger("libp2p.host.basic_host")
    host.error("Failed to open stream to peer 12D3KooWX:\n  Error: handshake read failed")
    logging.getLogger("libp2p.protocol_muxer.multiselect_client").error(
        "MultiselectClient handshake: read failed: %s", "fail to read")
    logging.getLogger("libp2p.stream_muxer.yamux.yamux").error(
        "Error in handle_incoming for peer 12D3KooWX: ClosedResourceError: ")
    host.error("listener failed to bind /ip4/0.0.0.0/tcp/4001")
    logging.getLogger("libp2p.pubsub.pubsub").warning("below the level: not shown")
    assert captured.messages == ["listener failed to bind /ip4/0.0.0.0/tcp/4001"]


def test_verbose_keeps_everything_and_a_second_call_replaces_the_filters(captured):
    quiet_libp2p(logging.ERROR)
    quiet_libp2p(logging.INFO, verbose=True)
    logging.getLogger("libp2p.host.basic_host").error("Failed to open stream to peer X")
    logging.getLogger("libp2p.pubsub.pubsub").info("mesh joined")
    assert captured.messages == ["Failed to open stream to peer X", "mesh joined"]
    quiet_libp2p(logging.ERROR)
    quiet_libp2p(logging.ERROR)
    assert len(logging.getLogger("libp2p.host.basic_host").filters) == 1
