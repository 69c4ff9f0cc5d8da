"""What py-libp2p logs as an error when a peer merely went away, kept off a user's console.

py-libp2p logs at ERROR level, with multi-line detail, whenever a connection closes under a
stream it was opening or reading: pubsub opening its stream to a peer whose dial-back probe has
already hung up, identify on a connection the guard just shed, yamux reading a socket the far
side closed. In a swarm peers come and go all the time, the callers handle the failure, and a
volunteer who sees "Failed to open stream to peer ... handshake read failed" blocks at every
start reads them as faults. :func:`quiet_libp2p` sets the levels the programs use for
libp2p's loggers and drops exactly those messages; ``--verbose`` keeps everything.
"""

from __future__ import annotations

import logging

# The loggers py-libp2p and its helpers write through (children inherit the level).
NOISY_LOGGERS = ("libp2p", "multiaddr", "async_service")
# Messages, by logger, that mean "the peer closed the connection": the start of each message.
# Anything else those loggers say at the level kept still reaches the console.
GONE_PEER = {
    "libp2p.host.basic_host": ("Failed to open stream to peer",),
    "libp2p.protocol_muxer.multiselect_client": (
        "MultiselectClient handshake: read failed",
        "MultiselectClient handshake: write failed",
    ),
    "libp2p.stream_muxer.yamux.yamux": ("Error in handle_incoming for peer",),
}


class GonePeerFilter(logging.Filter):
    """Drops a record whose message starts with one of ``starts`` (the peer went away)."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def quiet_libp2p(level: int, verbose: bool = False) -> None:
    """Set libp2p's loggers to ``level`` and, unless ``verbose``, drop the messages in
    :data:`GONE_PEER`. Idempotent: a second call replaces the filters it installed."""
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(level)
    for name, starts in GONE_PEER.items():
        log = logging.getLogger(name)
        for f in [f for f in log.filters if isinstance(f, GonePeerFilter)]:
            log.removeFilter(f)
        if not verbose:
            log.addFilter(GonePeerFilter(starts))
