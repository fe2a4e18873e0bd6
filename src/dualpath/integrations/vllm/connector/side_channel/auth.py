"""Who may use a decode node's staging service: peers that prove they hold the cluster's
shared secret, by an HMAC of a fresh nonce the service sends on every connection.

The secret protects the side channel only: staging slots, the store reads a `stage` asks for
(prompt content), and the NIXL agent metadata a `Hello` exchanges. It does not encrypt the
channel, and it does not guard NIXL's own transfers, which reach registered memory through
the agents' metadata (UCX over the fabric): keep the fabric and the side-channel ports on a
network only the cluster reaches.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Callable
from pathlib import Path

from dualpath.integrations.vllm.manifest import SIDE_CHANNEL_SECRET_ENV

SECRET_ENV = SIDE_CHANNEL_SECRET_ENV
"""The environment variable that holds the secret (the decode instance's service inherits
it; it never travels on a command line)."""
SECRET_FILE_ENV = "DUALPATH_SIDE_CHANNEL_SECRET_FILE"
"""...or names a file that holds it (a mounted Kubernetes Secret)."""
MIN_SECRET_BYTES = 16
_CONTEXT = b"dualpath-side-channel-v2\0"


class SecretError(ValueError):
    """A secret that is configured but unusable (too short, an unreadable file)."""


def load_secret(get: Callable[[str], object | None] = lambda _: None) -> bytes | None:
    """The shared secret: the connector's extra config (`get("side_channel_secret")`, or
    `get("side_channel_secret_file")`), else `$DUALPATH_SIDE_CHANNEL_SECRET`, else the file
    `$DUALPATH_SIDE_CHANNEL_SECRET_FILE` names; None when none is configured."""
    value = get("side_channel_secret") or os.environ.get(SECRET_ENV) or None
    where = "side_channel_secret" if get("side_channel_secret") else SECRET_ENV
    path = get("side_channel_secret_file") or os.environ.get(SECRET_FILE_ENV) or None
    if value is None and path is not None:
        where = str(path)
        try:
            value = Path(str(path)).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise SecretError(f"side channel secret file {path}: {e.strerror}") from None
    if value is None:
        return None
    secret = str(value).encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"{where}: the side channel secret must be at least "
                          f"{MIN_SECRET_BYTES} characters (e.g. `openssl rand -hex 32`)")
    return secret


def proof(secret: bytes, nonce: bytes) -> bytes:
    """What a peer sends for `nonce`: HMAC-SHA256 of it under the secret."""
    return hmac.new(secret, _CONTEXT + nonce, hashlib.sha256).digest()


def is_valid(secret: bytes, nonce: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(proof(secret, nonce), mac)


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
