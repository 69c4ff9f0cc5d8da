"""Per-peer budgets in rate and bytes: token buckets keyed by (peer, rpc) and (network prefix, rpc).

:class:`Gate` owns every bucket and every backoff of one host. A request is admitted when the
peer is not in backoff and both its own bucket and its network prefix's bucket (/24 for IPv4, /48
for IPv6: one machine or one home cannot escape its budget by minting identities) have a token
for the request and room for its bytes. A refusal costs the refused peer, not the host: the
caller closes the stream without reading further, and :meth:`Gate.punish` puts the peer in an
exponentially growing backoff during which every stream it opens is closed before a byte is read.

Every map is a bounded LRU (:class:`LruMap`): the least recently seen keys are dropped first, so
a flood of fresh identities costs at most ``max_keys`` small entries. Forgetting a peer forgets
its debt, which only ever errs towards a stranger's favour for peers not seen for a long time.

A prefix's share is ``prefix_factor`` peers' worth by default; an rpc may have a factor of its own
(:meth:`Gate.set_prefix_factor`): chunk serving gives a network two peers' worth, because its
byte budget is what a leecher minting identities on one /24 would otherwise multiply (8
identities on one /24 pulled 4.6 GB in 10 s from one learner; issue 26, finding 7). Responses
are charged too (:meth:`Gate.admit_response`), for every rpc with a limit of its own: a small
request may ask for a large reply (a 4 MiB manifest).

:class:`Audience` is whom a chunk server serves on their own budgets (the learner's: the nodes
of its recent plans and those whose groups it trained on); everyone else shares one small
strangers' bucket.

The buckets are pure and synchronous over an injectable monotonic clock; :class:`UploadLimiter`
(the host-wide upload cap) is the one part that waits. Nothing here raises for any input.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import trio

K = TypeVar("K")
V = TypeVar("V")

# Keys each map holds at most (per host): a few hundred bytes each, so about 10 MB at worst.
DEFAULT_MAX_KEYS = 20_000
# Backoff after a first violation, doubled per violation within the backoff's memory, capped.
BACKOFF_BASE_S = 2.0
BACKOFF_MAX_S = 300.0
# A prefix holds this many peers' worth of budget: a NAT or a lab shares one address honestly.
DEFAULT_PREFIX_FACTOR = 8.0
# Chunk bytes a network may pull, in peers' worth (Gate.set_prefix_factor). A network's nodes
# get most of a version pushed down the relay tree, and pull from many peers, each with its own
# gate; what one server's chunk budget has to cover is one node's catch-up and a second's.
CHUNK_PREFIX_FACTOR = 2.0
# Bytes/s a chunk server's Audience shares among all the peers outside it (a late joiner before
# its first plan; a stranger). About 32 Mbit/s: a 270 MB anchor in ~70 s for one newcomer, while
# the planned nodes keep the learner's uplink.
STRANGER_BYTES_PER_S = 4e6
# What strangers may take together of a volunteer node's uplink: 8 Mbit/s, a home uplink's
# share that a late joiner's pull still finishes with (the learner serves them too). Measured in
# benchmarks/attack.py: at the learner's 4 MB/s two honest nodes served identity leeches about
# 7 MB/s between them, on the core their inference shares.
NODE_STRANGER_BYTES_PER_S = 1e6
# Where a server has an upload cap, strangers share at most this part of it: a quarter leaves
# the plan most of it.
STRANGER_SHARE = 0.25
# Plans whose members stay in an Audience: a node planned for a version may still be pulling it
# (or a patch before it) while the next few versions are planned.
AUDIENCE_PLANS = 4


@dataclass(frozen=True)
class Limit:
    """The budget of one rpc for one peer: sustained requests/s and bytes/s, and their bursts."""

    requests_per_s: float
    burst_requests: float
    bytes_per_s: float
    burst_bytes: float

    def scaled(self, factor: float) -> Limit:
        """The same limit ``factor`` times larger (a network prefix's share)."""
        return Limit(
            self.requests_per_s * factor,
            self.burst_requests * factor,
            self.bytes_per_s * factor,
            self.burst_bytes * factor,
        )


# Generous enough that no honest exchange of ours comes near it (a node sends a few requests a
# second); protocols without their own entry get it.
DEFAULT_LIMIT = Limit(requests_per_s=50.0, burst_requests=200.0, bytes_per_s=32e6, burst_bytes=64e6)


class LruMap(Generic[K, V]):
    """A dict that keeps at most ``max_keys`` keys, dropping the least recently used first."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max(1, max_keys)
        self._d: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The value of ``key`` (now the most recently used), or None."""
        value = self._d.get(key)
        if value is not None:
            self._d.move_to_end(key)
        return value

    def setdefault(self, key: K, make: Callable[[], V]) -> V:
        """The value of ``key``, created with ``make()`` (evicting the oldest key) if absent."""
        value = self.get(key)
        if value is None:
            value = make()
            self._d[key] = value
            while len(self._d) > self.max_keys:
                self._d.popitem(last=False)
        return value

    def put(self, key: K, value: V) -> None:
        """Set ``key`` to ``value`` (now the most recently used), evicting the oldest key."""
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.max_keys:
            self._d.popitem(last=False)

    def pop(self, key: K) -> V | None:
        return self._d.pop(key, None)

    def items(self) -> list[tuple[K, V]]:
        """A snapshot of the entries, least recently used first."""
        return list(self._d.items())

    def __len__(self) -> int:
        return len(self._d)


class Bucket:
    """Two token buckets (requests, bytes) refilled at a limit's rates up to its bursts."""

    __slots__ = ("limit", "requests", "bytes", "stamp")

    def __init__(self, limit: Limit, now: float) -> None:
        self.limit = limit
        self.requests = limit.burst_requests
        self.bytes = limit.burst_bytes
        self.stamp = now

    def _refill(self, now: float) -> None:
        dt = max(0.0, now - self.stamp)
        self.stamp = now
        lim = self.limit
        self.requests = min(lim.burst_requests, self.requests + dt * lim.requests_per_s)
        self.bytes = min(lim.burst_bytes, self.bytes + dt * lim.bytes_per_s)

    def can(self, now: float, requests: float, nbytes: float) -> bool:
        self._refill(now)
        return self.requests >= requests and self.bytes >= nbytes

    def take(self, requests: float, nbytes: float) -> None:
        self.requests -= requests
        self.bytes -= nbytes


@dataclass
class _Backoff:
    until: float
    strikes: int


def network_prefix(address: str | None, loopback_is_network: bool = False) -> str | None:
    """The /24 (IPv4) or /48 (IPv6) network of ``address``; None for none or a malformed one.
    Loopback is None too (one machine running many nodes on purpose: a test swarm, a benchmark)
    unless ``loopback_is_network``: then each loopback address is a network of its own
    (``127.0.0.2/32``), so a benchmark can run attackers from 127.0.0.2 beside honest nodes on
    127.0.0.1 and see the prefix budgets work."""
    if not address:
        return None
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    if ip.is_loopback:
        return str(ipaddress.ip_network(ip)) if loopback_is_network else None
    bits = 24 if ip.version == 4 else 48
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))


class Gate:
    """Admission of requests per (peer, rpc) and per (prefix, rpc); see the module docstring.

    ``limits`` maps an rpc name (a protocol id) to its per-peer :class:`Limit`; others get
    ``default``. A prefix's limit is the peer's times ``prefix_factor``.
    """

    def __init__(
        self,
        limits: Mapping[str, Limit] | None = None,
        *,
        default: Limit = DEFAULT_LIMIT,
        prefix_factor: float = DEFAULT_PREFIX_FACTOR,
        max_keys: int = DEFAULT_MAX_KEYS,
        backoff_base_s: float = BACKOFF_BASE_S,
        backoff_max_s: float = BACKOFF_MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = dict(limits or {})
        self.default = default
        self.prefix_factor = prefix_factor
        self.prefix_factors: dict[str, float] = {}  # rpcs whose prefix share is their own
        # Each loopback address its own prefix (see :func:`network_prefix`); off: none.
        self.loopback_is_network = False
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.clock = clock
        self._buckets: LruMap[tuple[str, str], Bucket] = LruMap(max_keys)
        self._backoff: LruMap[str, _Backoff] = LruMap(max_keys)
        # The last address each peer was seen at, so that charges made without one (a handler
        # that knows only the peer id) still reach its prefix.
        self._where: LruMap[str, str] = LruMap(max_keys)
        # Refusals since the gate started, by rpc (for metrics and tests).
        self.refused: dict[str, int] = {}

    def set_limit(self, rpc: str, limit: Limit) -> None:
        """Budget ``rpc`` with ``limit`` per peer from now on, buckets already made included
        (their tokens are kept, capped at the new bursts on their next refill)."""
        self.limits[rpc] = limit
        factor = self.prefix_factor_of(rpc)
        for (who, key_rpc), bucket in self._buckets.items():
            if key_rpc == rpc:
                # Prefix keys are networks ("a.b.c.0/24"); peer ids never hold a '/'.
                bucket.limit = limit.scaled(factor) if "/" in who else limit

    def set_prefix_factor(self, rpc: str, factor: float) -> None:
        """Give each network prefix ``factor`` peers' worth of ``rpc`` (instead of
        :attr:`prefix_factor`) from now on, prefix buckets already made included (their tokens
        capped at the new bursts)."""
        self.prefix_factors[rpc] = factor
        scaled = self.limit(rpc).scaled(factor)
        for (who, key_rpc), bucket in self._buckets.items():
            if key_rpc == rpc and "/" in who:
                bucket.limit = scaled
                bucket.requests = min(bucket.requests, bucket.limit.burst_requests)
                bucket.bytes = min(bucket.bytes, bucket.limit.burst_bytes)

    def prefix_factor_of(self, rpc: str) -> float:
        """How many peers' worth of ``rpc`` a network prefix gets."""
        return self.prefix_factors.get(rpc, self.prefix_factor)

    def raise_burst(self, rpc: str, burst_bytes: float) -> None:
        """Raise ``rpc``'s byte burst to ``burst_bytes`` (a smaller value changes nothing); the
        buckets already made get the difference at once, as a bucket made now would."""
        limit = self.limit(rpc)
        extra = burst_bytes - limit.burst_bytes
        if extra <= 0:
            return
        self.set_limit(rpc, dataclasses.replace(limit, burst_bytes=burst_bytes))
        factor = self.prefix_factor_of(rpc)
        for (who, key_rpc), bucket in self._buckets.items():
            if key_rpc == rpc:
                bucket.bytes += extra * (factor if "/" in who else 1.0)

    def resize(self, max_keys: int) -> None:
        """Keep at most ``max_keys`` keys per map from now on (applied as keys are added)."""
        for lru in (self._buckets, self._backoff, self._where):
            lru.max_keys = max(1, max_keys)

    def limit(self, rpc: str) -> Limit:
        """The per-peer limit of ``rpc``."""
        return self.limits.get(rpc, self.default)

    def in_backoff(self, peer: str) -> bool:
        """True while ``peer`` serves a backoff (every stream it opens is closed unread)."""
        return self.backoff_left(peer) > 0.0

    def backoff_left(self, peer: str) -> float:
        """Seconds ``peer``'s backoff still runs (0.0 when it serves none)."""
        b = self._backoff.get(peer)
        return 0.0 if b is None else max(0.0, b.until - self.clock())

    def admit(self, peer: str, address: str | None, rpc: str, nbytes: int = 0) -> bool:
        """Charge one request of ``nbytes`` to ``peer`` and its prefix; False (nothing charged)
        when the peer is in backoff or either budget is spent."""
        return self._charge(peer, address, rpc, 1.0, float(nbytes))

    def admit_bytes(self, peer: str, address: str | None, rpc: str, nbytes: int) -> bool:
        """Charge ``nbytes`` more of a request already admitted (e.g. a body announced by its
        header, or a response about to be sent); False (nothing charged) when over budget."""
        return self._charge(peer, address, rpc, 0.0, float(nbytes))

    def admit_response(self, peer: str, address: str | None, rpc: str, nbytes: int) -> bool:
        """Charge a response of ``nbytes`` about to be sent for ``rpc``; False (nothing charged)
        when over budget (a backoff alone does not refuse it: the request was admitted). Only
        rpcs with a limit of their own (:meth:`set_limit`) are charged: the generous default
        budgets requests, not the replies of trusted exchanges. At most the peer's byte burst
        is charged, so one reply larger than the burst (a manifest near its 4 MiB cap) can
        still be served from a full bucket."""
        limit = self.limits.get(rpc)
        if limit is None:
            return True
        # A backoff the handler itself just imposed does not eat the reply that says why.
        charge = min(float(nbytes), limit.burst_bytes)
        return self._charge(peer, address, rpc, 0.0, charge, backoff_refuses=False)

    def _charge(
        self,
        peer: str,
        address: str | None,
        rpc: str,
        requests: float,
        nbytes: float,
        *,
        backoff_refuses: bool = True,
    ) -> bool:
        now = self.clock()
        if backoff_refuses and self.in_backoff(peer):
            self._refuse(rpc)
            return False
        if address:
            self._where.setdefault(peer, lambda: address)
        else:
            address = self._where.get(peer)
        limit = self.limit(rpc)
        mine = self._buckets.setdefault((peer, rpc), lambda: Bucket(limit, now))
        prefix = network_prefix(address, self.loopback_is_network)
        theirs = None
        if prefix is not None:
            scaled = limit.scaled(self.prefix_factor_of(rpc))
            theirs = self._buckets.setdefault((prefix, rpc), lambda: Bucket(scaled, now))
        if not mine.can(now, requests, nbytes) or (
            theirs is not None and not theirs.can(now, requests, nbytes)
        ):
            self._refuse(rpc)
            return False
        mine.take(requests, nbytes)
        if theirs is not None:
            theirs.take(requests, nbytes)
        return True

    def _refuse(self, rpc: str) -> None:
        self.refused[rpc] = self.refused.get(rpc, 0) + 1

    def punish(self, peer: str) -> float:
        """Put ``peer`` in backoff (doubling with each violation it commits while remembered);
        returns the backoff's length in seconds."""
        now = self.clock()
        b = self._backoff.get(peer)
        strikes = 1 if b is None else b.strikes + 1
        length = min(self.backoff_max_s, self.backoff_base_s * 2 ** (strikes - 1))
        if b is None:
            self._backoff.setdefault(peer, lambda: _Backoff(now + length, strikes))
        else:
            b.until, b.strikes = now + length, strikes
        return length

    def sizes(self) -> dict[str, int]:
        """How many keys each map holds (they level off at ``max_keys``)."""
        return {
            "buckets": len(self._buckets),
            "backoff": len(self._backoff),
            "addresses": len(self._where),
        }


class Audience:
    """Whom a chunk server serves on their own budgets: the members of its last
    :data:`AUDIENCE_PLANS` plans (:meth:`planned`) and the peers whose work it has seen accepted
    (:meth:`proven`, at most ``max_keys``, least recently seen dropped). Everyone else --
    identities are free -- shares one bucket of ``stranger_bps`` whose burst is what the caller
    names (the largest version held: one newcomer's first pull), so strangers together cannot
    take more of the server's uplink than that (issue 26, finding 7). Pure; raises nothing."""

    def __init__(
        self,
        stranger_bps: float = STRANGER_BYTES_PER_S,
        *,
        max_keys: int = DEFAULT_MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stranger_bps = stranger_bps
        self._clock = clock
        self._plans: OrderedDict[object, frozenset[str]] = OrderedDict()
        self._proven: LruMap[str, bool] = LruMap(max_keys)
        self._tokens: float | None = None  # the strangers' bucket (None: full, not yet used)
        self._stamp = clock()
        self.refused = 0  # strangers' requests refused, ever

    def planned(self, key: object, peers: Iterable[str]) -> None:
        """The members of a new plan (``key``: its version); the oldest plan beyond
        :data:`AUDIENCE_PLANS` is forgotten."""
        self._plans.pop(key, None)
        self._plans[key] = frozenset(peers)
        while len(self._plans) > AUDIENCE_PLANS:
            self._plans.popitem(last=False)

    def proven(self, peer: str) -> None:
        """``peer`` delivered accepted work (a group the server trained on, a lease it held)."""
        self._proven.put(peer, True)

    def __contains__(self, peer: str) -> bool:
        return self._proven.get(peer) is not None or any(peer in p for p in self._plans.values())

    def admit(self, peer: str, nbytes: int, burst: float) -> bool:
        """True for a member; for anyone else, charge ``nbytes`` to the strangers' bucket
        (refilled at ``stranger_bps`` up to ``burst``): False, charging nothing, when it is
        spent."""
        if peer in self:
            return True
        now = self._clock()
        burst = max(burst, float(nbytes))  # one request larger than the burst still fits once
        tokens = burst if self._tokens is None else self._tokens
        tokens = min(burst, tokens + (now - self._stamp) * self.stranger_bps)
        self._stamp = now
        if tokens < nbytes:
            self._tokens = tokens
            self.refused += 1
            return False
        self._tokens = tokens - nbytes
        return True


def stranger_bps(upload_limit_bps: float | None, ceiling: float) -> float:
    """The strangers' shared rate at a chunk server: ``ceiling``, or :data:`STRANGER_SHARE`
    of the server's upload cap where it has one (None or 0: none) and that is less."""
    if upload_limit_bps:
        return min(ceiling, STRANGER_SHARE * upload_limit_bps)
    return ceiling


class UploadLimiter:
    """A host's upload cap, shared by everything that uploads (relay pushes, chunks served):
    ``await take(n)`` waits until ``n`` bytes of budget accrued at ``rate_bps``."""

    def __init__(self, rate_bps: float, burst: float) -> None:
        self.rate, self.burst = rate_bps, burst
        self.tokens = burst
        self.stamp = trio.current_time()

    async def take(self, n: int) -> None:
        """Spend ``n`` bytes, sleeping off any debt (the caller uploads after it returns)."""
        now = trio.current_time()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= n
        if self.tokens < 0:
            await trio.sleep(-self.tokens / self.rate)
