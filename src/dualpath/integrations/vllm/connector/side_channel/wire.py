"""The side channel's messages: typed requests and their replies, one JSON object per line.

On the wire a message is `{"v": PROTOCOL_VERSION, "type": "<class name>", <fields>}`; `bytes`
fields travel as hex. Every request has one reply type (`REPLY_OF`), or `Failed` with the
reason (the client raises it as `SideChannelError`).

A connection opens with the service's `Challenge`; where it requires it, the peer's first
request is `Auth`, the proof that it holds the cluster's secret (`auth`), and any other
request before it is refused and the connection closed.
"""

from __future__ import annotations

import json
import types
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

PROTOCOL_VERSION = 2


class SideChannelError(RuntimeError):
    """A side-channel request the decode instance refused, or a broken connection."""


class Message:
    """A side-channel message: a frozen dataclass of one of the two kinds below."""

    @property
    def op(self) -> str:
        """The message's name in the event log (`stage`, `alloc`, ...)."""
        return type(self).__name__.lower()


class Request(Message):
    """What a worker asks the staging service; answered by its `REPLY_OF` type or `Failed`."""


class Reply(Message):
    """What the staging service answers."""


# -- requests ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Auth(Request):
    """The proof of the shared secret for this connection's challenge (`auth.proof`)."""

    mac: bytes


@dataclass(frozen=True)
class Hello(Request):
    """Exchange agents: the peer's NIXL metadata (empty: only read the decode side's info)."""

    agent: bytes = b""


@dataclass(frozen=True)
class Stage(Request):
    """Read blocks `first_block ..` of `xfer` into staging slots, a slot per block: `keys`
    are the store keys of the files holding them (file `i`: blocks `[i * g, (i + 1) * g)`, g
    the service's blocks per file; a file's blocks outside the range are read and dropped)."""

    xfer: str
    first_block: int
    keys: tuple[bytes, ...]
    num_blocks: int = 0
    """Blocks to stage (0: one per key, files of one block)."""


@dataclass(frozen=True)
class _OfXfer(Request):
    xfer: str


@dataclass(frozen=True)
class _OfBlocks(_OfXfer):
    blocks: tuple[int, ...]


class Alloc(_OfBlocks):
    """Slots for `blocks` of `xfer`, for the prefill worker to write (a block given twice
    keeps its slot)."""


@dataclass(frozen=True)
class Commit(_OfXfer):
    """The prefill worker's writes into `xfer`'s slots are complete. `crcs[i]`: the digest of
    the Full Block it wrote for `blocks[i]` (`connector.digest`: a CRC32C of host pages, a word
    sum computed on the GPU of GPU pages), which the decode worker checks before loading the
    slot."""

    blocks: tuple[int, ...] = ()
    crcs: tuple[int, ...] = ()


class Lookup(_OfBlocks):
    """The decode worker: which slots hold valid bytes of `blocks` of `xfer`."""


class Release(_OfXfer):
    """The decode worker loaded `xfer`: its slots go back to the pool."""


# -- replies -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Challenge(Reply):
    """What the service sends first on every connection: a fresh nonce, and whether an
    `Auth` must answer it before any other request."""

    nonce: bytes
    is_required: bool


@dataclass(frozen=True)
class Welcome(Reply):
    """Reply to `Hello`: the decode side's agent and its staging buffer."""

    agent: bytes
    full_block_bytes: int
    namespace: str
    num_slots: int
    shm: str
    """The staging buffer's shared-memory name (the decode worker maps it)."""
    address: int
    """The staging buffer's first byte in the staging service (slot `i` at `address + i *
    full_block_bytes`, registered with its NIXL agent): a prefill prepares its descriptors of
    every slot once."""


@dataclass(frozen=True)
class Staged(Reply):
    """Reply to `Stage`: the addresses of the slots of the blocks read, a prefix of those
    asked for (the prefill side recomputes from the first missing one on)."""

    slots: tuple[int, ...]
    read_s: float
    """Time spent reading the store."""


@dataclass(frozen=True)
class Slots(Reply):
    """Reply to `Alloc`: one slot address per block asked for."""

    slots: tuple[int, ...]


@dataclass(frozen=True)
class Found(Reply):
    """Reply to `Lookup`: each block's slot index, None where it holds no valid bytes, and
    the CRC32C its writer gave for it (None: none given; `()` from an older service)."""

    slots: tuple[int | None, ...]
    crcs: tuple[int | None, ...] = ()


@dataclass(frozen=True)
class Done(Reply):
    """Reply to `Auth`, `Commit` and `Release`."""


@dataclass(frozen=True)
class Failed(Reply):
    """Any request the decode side could not serve, and why."""

    error: str


REPLY_OF: dict[type[Request], type[Reply]] = {
    Auth: Done, Hello: Welcome, Stage: Staged, Alloc: Slots, Commit: Done, Lookup: Found,
    Release: Done}
_TYPES: dict[str, type[Message]] = {
    t.__name__: t for t in (*REPLY_OF, Challenge, Welcome, Staged, Slots, Found, Done, Failed)}

M = TypeVar("M", bound=Reply)


def _to_json(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, tuple):
        return [_to_json(v) for v in value]
    return value


def _from_json(hint: Any) -> Callable[[Any], Any]:
    """The decoder of a field of type `hint` (bytes, int, float, str, tuples and optionals)."""
    if hint is bytes:
        return bytes.fromhex
    if hint is bool:
        def flag(v: Any) -> bool:
            if not isinstance(v, bool):
                raise TypeError(f"{v!r} is not bool")
            return v
        return flag
    if hint in (int, float, str):
        def scalar(v: Any) -> Any:
            if hint is float and isinstance(v, int):
                v = float(v)
            if not isinstance(v, hint) or isinstance(v, bool):
                raise TypeError(f"{v!r} is not {hint.__name__}")
            return v
        return scalar
    origin, args = get_origin(hint), get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _from_json(args[0])
        return lambda v: tuple(item(x) for x in v)
    if origin in (Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        some = _from_json(inner)
        return lambda v: None if v is None else some(v)
    raise TypeError(f"no wire form for {hint!r}")


_DECODERS: dict[type[Message], dict[str, Callable[[Any], Any]]] = {
    t: {name: _from_json(hint) for name, hint in get_type_hints(t).items()}
    for t in _TYPES.values()}


def encode(msg: Message) -> bytes:
    """One line of JSON: the message's type, the protocol version and its fields."""
    body = {f.name: _to_json(getattr(msg, f.name)) for f in fields(msg)}  # type: ignore[arg-type]
    return (json.dumps({"v": PROTOCOL_VERSION, "type": type(msg).__name__, **body}) + "\n"
            ).encode()


def decode(line: bytes) -> Message:
    """The message of one line; a line that is not one (bad JSON, another protocol version,
    an unknown type, a missing or mistyped field) is a `SideChannelError` naming why."""
    try:
        raw = json.loads(line)
    except ValueError as e:
        raise SideChannelError(f"not a side-channel message ({e})") from None
    if not isinstance(raw, dict):
        raise SideChannelError("not a side-channel message (not a JSON object)")
    version = raw.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise SideChannelError(f"side-channel protocol v{version}, this side speaks "
                               f"v{PROTOCOL_VERSION}")
    name = raw.pop("type", None)
    cls = _TYPES.get(str(name))
    if cls is None:
        raise SideChannelError(f"unknown side-channel message type {name!r}")
    decoders = _DECODERS[cls]
    unknown = set(raw) - set(decoders)
    if unknown:
        raise SideChannelError(f"{name}: unknown fields {sorted(unknown)}")
    try:
        return cls(**{k: decoders[k](v) for k, v in raw.items()})
    except (TypeError, ValueError) as e:
        raise SideChannelError(f"{name}: {e}") from None


def expect(reply: Message, cls: type[M], address: str) -> M:
    """`reply` as `cls`; a `Failed` reply or one of another type is a `SideChannelError`."""
    if isinstance(reply, Failed):
        raise SideChannelError(f"side channel {address}: {reply.error}")
    if not isinstance(reply, cls):
        raise SideChannelError(f"side channel {address}: a {type(reply).__name__} reply, "
                               f"expected {cls.__name__}")
    return reply
