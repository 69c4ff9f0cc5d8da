"""echo.p2p.identity: key file handling and peer-id <-> public-key binding."""

import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from libp2p.crypto.rsa import create_new_key_pair as create_rsa_key_pair
from libp2p.peer.id import ID

from echo.p2p.identity import (
    Identity,
    InsecureKeyFileError,
    KeyFileError,
    default_key_path,
    public_key_from_peer_id,
)
from echo.protocol.errors import ProtocolError


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_create_and_reload(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "identity.key"
    first = Identity.load_or_create(path)
    assert path.read_bytes() and len(path.read_bytes()) == 32
    assert _mode(path) == 0o600
    assert _mode(path.parent) == 0o700
    assert not [p for p in path.parent.iterdir() if p.name != "identity.key"]  # no temp left
    again = Identity.load_or_create(path)
    assert again.peer_id == first.peer_id
    assert again.peer_id_str == first.peer_id_str
    assert again.public_key_bytes == first.public_key_bytes


def test_refuses_group_readable_key(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    Identity.load_or_create(path)
    os.chmod(path, 0o640)
    with pytest.raises(InsecureKeyFileError):
        Identity.load_or_create(path)
    os.chmod(path, 0o600)
    Identity.load_or_create(path)


def test_refuses_wrong_size(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"short")
    os.close(fd)
    with pytest.raises(KeyFileError):
        Identity.load_or_create(path)


def test_default_path_is_user_data_dir() -> None:
    path = default_key_path()
    assert path.name == "identity.key" and "echo-swarm" in str(path)


def test_sign_verifies_with_key_from_peer_id() -> None:
    ident = Identity.generate()
    raw = public_key_from_peer_id(ident.peer_id)
    assert raw == ident.public_key_bytes
    assert public_key_from_peer_id(ident.peer_id_str) == raw
    assert public_key_from_peer_id(ident.peer_id.to_bytes()) == raw
    sig = ident.sign(b"message")
    Ed25519PublicKey.from_public_bytes(raw).verify(sig, b"message")
    # The libp2p key pair is the same key.
    assert ident.libp2p_keypair().public_key.to_bytes() == raw
    assert Identity.from_seed(bytes(32)).peer_id == Identity.from_seed(bytes(32)).peer_id


def test_public_key_from_non_ed25519_peer_id() -> None:
    rsa_id = ID.from_pubkey(create_rsa_key_pair().public_key)  # sha2-256 multihash
    with pytest.raises(ProtocolError):
        public_key_from_peer_id(rsa_id)
    ed = Identity.generate().peer_id.to_bytes()
    for bad in (b"", ed[:-1], ed + b"\x00", b"\x00\x24\x08\x02" + ed[4:]):
        with pytest.raises(ProtocolError):
            public_key_from_peer_id(bad)
    with pytest.raises(ProtocolError):
        public_key_from_peer_id("not-base58-0OIl")
