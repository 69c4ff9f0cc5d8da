"""The relay's timeouts and limits (:class:`RelayConfig`), shared by all its jobs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RelayConfig:
    """Timeouts and limits of a relay (seconds, chunks, bytes per second)."""

    # No byte from a parent for this long: report it as stalled and pull its stripes. A parent that
    # is only waiting for its own upstream sends keep-alives; then the child pulls after twice this.
    stall_timeout_s: float = 10.0
    # A parent with nothing new to push sends a keep-alive this often.
    idle_interval_s: float = 2.0
    # A child this many chunks behind its fastest sibling (by acknowledged chunks) is dropped and
    # pulls (0: never drop).
    max_lag_chunks: int = 64
    # Unacknowledged bytes per child, at most: the bounded per-child queue. Within it the window
    # follows what the child acknowledges (about half a second of its rate, at least two chunks),
    # so that little waits in send buffers ahead of control frames on the same connection.
    push_window_bytes: int = 2 * 1024 * 1024
    # Concurrent chunk pulls per transfer, and the timeout of one.
    pull_parallel: int = 4
    pull_timeout_s: float = 30.0
    # A chunk no peer could give is retried after this long.
    pull_retry_s: float = 0.5
    # A wanted chunk no other peer shows in its have-map is pulled from the origin after this.
    origin_grace_s: float = 2.0
    connect_timeout_s: float = 10.0
    hello_timeout_s: float = 10.0
    # Writing one chunk may take this plus its size at rpc.MIN_TRANSFER_RATE.
    write_base_timeout_s: float = 10.0
    # Versions tracked at once; beyond it the oldest (completed first) are dropped.
    max_transfers: int = 4
    # Optional cap on this host's upload: relay pushes and the chunks it serves to pullers share it.
    upload_limit_bps: float | None = None
    # Recently arrived chunks kept in memory for forwarding (saves a disk read per child).
    forward_cache_bytes: int = 32 * 1024 * 1024
