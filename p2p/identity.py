"""A volunteer's Ed25519 identity: one key that signs protocol messages and is its libp2p peer id.

Owns the private-key file: a raw 32-byte Ed25519 seed, written atomically (temp file created 0600,
fsync, rename) in a directory created 0700. An existing key file that is readable or writable by
group/others is *refused* (:class:`InsecureKeyFileError`): the key may already have leaked, so
silently tightening the mode would hide that; the volunteer must fix or delete it.

Also owns :func:`public_key_from_peer_id`, which the coordinator uses to bind a signed message to
the peer that Noise authenticated: the peer id of an Ed25519 key embeds the raw public key.

Errors: :class:`KeyFileError` (and its subclass :class:`InsecureKeyFileError`) for an unusable key
file, ``OSError`` from the filesystem as is, ``echo.protocol.errors.ProtocolError`` for peer ids
that are not Ed25519 identity multihashes.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import platformdirs
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from libp2p.crypto.ed25519 import Ed25519PrivateKey as Libp2pEd25519PrivateKey
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from echo.protocol.errors import ProtocolError

logger = logging.getLogger(__name__)

# platformdirs app name; the key lives in the per-user data dir, not in the working directory,
# so running `echo-node` from different folders keeps one identity (and one reputation).
APP_NAME = "echo-swarm"
KEY_FILE_NAME = "identity.key"

SEED_LEN = 32
PUBLIC_KEY_LEN = 32

# Canonical libp2p encoding of an Ed25519 peer id: identity multihash (code 0x00, length 36)
# wrapping the protobuf PublicKey {Type: Ed25519 (1), Data: 32 bytes}. Anything else (RSA /
# secp256k1 keys, sha2-256 multihashes, non-canonical protobuf) is not accepted.
_ED25519_PEER_ID_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])

# Key file and directory modes: private to the user.
_FILE_MODE = 0o600
_DIR_MODE = 0o700


class KeyFileError(RuntimeError):
    """The identity key file exists but cannot be used (wrong size, unreadable)."""


class InsecureKeyFileError(KeyFileError):
    """The identity key file is accessible to group or others; it is refused, not fixed."""


def default_key_path() -> Path:
    """``<user data dir>/echo-swarm/identity.key`` (platform specific)."""
    return Path(platformdirs.user_data_dir(APP_NAME)) / KEY_FILE_NAME


class Identity:
    """An Ed25519 key pair; the libp2p peer id is derived from its public key."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self._seed = private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        self._public_key_bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self._keypair = _libp2p_keypair_from_seed(self._seed)
        self._peer_id = ID.from_pubkey(self._keypair.public_key)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random identity (not persisted)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """The identity whose private key is the 32-byte Ed25519 ``seed``."""
        if len(seed) != SEED_LEN:
            raise ValueError(f"an Ed25519 seed is {SEED_LEN} bytes, got {len(seed)}")
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(seed)))

    @classmethod
    def load_or_create(cls, path: Path | None = None) -> Identity:
        """Load the identity from ``path`` (default :func:`default_key_path`); create it if absent.

        :raises InsecureKeyFileError: the file is group/world accessible.
        :raises KeyFileError: the file is not a 32-byte seed.
        """
        path = Path(path) if path is not None else default_key_path()
        if path.exists():
            return cls._load(path)
        identity = cls.generate()
        identity._save_new(path)
        logger.info("created new identity %s at %s", identity.peer_id_str, path)
        return identity

    @classmethod
    def _load(cls, path: Path) -> Identity:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"identity key {path} is not a regular file")
        if os.name == "posix" and st.st_mode & 0o077:
            raise InsecureKeyFileError(
                f"identity key {path} has mode {stat.S_IMODE(st.st_mode):o}; it must be private "
                f"to its owner. Run `chmod 600 {path}` if you are sure nobody copied it, "
                "or delete it to get a new identity."
            )
        seed = path.read_bytes()
        if len(seed) != SEED_LEN:
            raise KeyFileError(
                f"identity key {path} holds {len(seed)} bytes, expected a {SEED_LEN}-byte seed"
            )
        return cls.from_seed(seed)

    def _save_new(self, path: Path) -> None:
        """Write the seed atomically; never overwrites an existing file."""
        path.parent.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
        try:
            try:
                os.write(fd, self._seed)
                os.fsync(fd)
            finally:
                os.close(fd)
            # link() fails if another process created the key meanwhile: keep theirs.
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise KeyFileError(
                    f"identity key {path} was created concurrently; load it instead"
                ) from None
            except OSError:
                # Filesystems without hard links: fall back to rename (may replace a racer's key).
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    # -- properties -----------------------------------------------------------------------------

    @property
    def private_key(self) -> Ed25519PrivateKey:
        return self._private_key

    @property
    def public_key_bytes(self) -> bytes:
        """The raw 32-byte Ed25519 public key."""
        return self._public_key_bytes

    @property
    def peer_id(self) -> ID:
        return self._peer_id

    @property
    def peer_id_str(self) -> str:
        return self._peer_id.to_base58()

    def sign(self, data: bytes) -> bytes:
        """A 64-byte Ed25519 signature of ``data``."""
        return self._private_key.sign(data)

    def libp2p_keypair(self) -> KeyPair:
        """The same key as a py-libp2p ``KeyPair`` (for the host and Noise)."""
        return self._keypair

    def __repr__(self) -> str:
        return f"Identity({self.peer_id_str})"


def _libp2p_keypair_from_seed(seed: bytes) -> KeyPair:
    priv = Libp2pEd25519PrivateKey.from_bytes(seed)
    return KeyPair(priv, priv.get_public_key())


def public_key_from_peer_id(peer_id: ID | str | bytes) -> bytes:
    """The raw 32-byte Ed25519 public key embedded in an Ed25519 peer id.

    ``peer_id`` may be a libp2p ``ID``, its base58 string, or its raw multihash bytes.

    :raises ProtocolError: the id is malformed or not an Ed25519 identity multihash.
    """
    if isinstance(peer_id, ID):
        raw = peer_id.to_bytes()
    elif isinstance(peer_id, str):
        try:
            raw = ID.from_base58(peer_id).to_bytes()
        except Exception as exc:
            raise ProtocolError(f"malformed peer id {peer_id!r}", code="peer_id") from exc
    elif isinstance(peer_id, bytes | bytearray | memoryview):
        raw = bytes(peer_id)
    else:
        raise TypeError(f"expected ID, str or bytes, got {type(peer_id).__name__}")
    if len(raw) != len(_ED25519_PEER_ID_PREFIX) + PUBLIC_KEY_LEN or not raw.startswith(
        _ED25519_PEER_ID_PREFIX
    ):
        raise ProtocolError("peer id is not an Ed25519 identity multihash", code="peer_id")
    key = raw[len(_ED25519_PEER_ID_PREFIX) :]
    try:
        Ed25519PublicKey.from_public_bytes(key)
    except ValueError as exc:
        raise ProtocolError("peer id holds an invalid Ed25519 key", code="peer_id") from exc
    return key
