"""Both ends of the upstream handshake (SPEC §2.6): the coordinator up to an authenticated
Hello, and the relay through HelloAck."""

from __future__ import annotations

import hmac
import secrets

import attrs
import trio

from .._errors import AuthError, FrameTooLarge, WireError
from .._transport import receive_exactly
from ..wire import (
    CHANNEL_MAGIC_CONTROL,
    CHANNEL_MAGIC_DATA,
    CHANNEL_MAGIC_JOIN,
    CHANNEL_MAGIC_RENDEZVOUS,
    COORD_TO_RELAY,
    MAX_RECORD_PAYLOAD,
    NONCE_LEN,
    RELAY_TO_COORD,
    Challenge,
    Hello,
    HelloAck,
    Record,
    RecordKind,
    RecordOpener,
    RecordSealer,
    SessionSalt,
    conn_key,
    decode_relay,
    encode,
    hs_key,
)

# A Hello is small; refuse big pre-auth records so a stranger cannot make us buffer megabytes.
MAX_HANDSHAKE_PAYLOAD = 256 * 1024

_OTHER_LEGS = {
    CHANNEL_MAGIC_DATA: "data",
    CHANNEL_MAGIC_RENDEZVOUS: "rendezvous",
    CHANNEL_MAGIC_JOIN: "join",
}


class Rejected(Exception):
    """A connection failed before authenticating. ``category`` groups rejects in reports."""

    def __init__(self, category: str, detail: str) -> None:
        super().__init__(detail)
        self.category = category
        self.detail = detail


@attrs.define
class AuthenticatedHello:
    hello: Hello
    coord_nonce: bytes
    sealer: RecordSealer
    opener: RecordOpener


async def read_record(
    stream: trio.abc.ReceiveStream, opener: RecordOpener, *, what: str
) -> Record:
    """Receive until ``opener`` yields one record (the caller bounds the time)."""
    while True:
        rec = opener.next_record()
        if rec is not None:
            return rec
        chunk = await stream.receive_some(65536)
        if not chunk:
            err = opener.eof_error(what)
            if err is not None:
                raise err
            raise WireError(f"{what}: peer closed the connection before the record arrived")
        opener.push(chunk)


async def coordinator_handshake(
    stream: trio.abc.Stream, salt: SessionSalt, peer: str, *, max_hello: int
) -> AuthenticatedHello:
    """Magic, Challenge, then an authenticated Hello. The caller bounds it by handshake_timeout.

    Raises:
        Rejected: anything that goes wrong before the Hello's MAC verified.
    """
    try:
        magic = await receive_exactly(stream, 4, what=f"handshake from {peer}")
    except WireError as exc:
        raise Rejected("eof before magic", f"{peer}: {exc}") from None
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        raise Rejected("connection error", f"{peer}: {exc!r}") from None
    if magic != CHANNEL_MAGIC_CONTROL:
        leg = _OTHER_LEGS.get(magic)
        if leg is not None:
            raise Rejected(
                "wrong leg", f"{peer}: expected the control magic, got the {leg} leg's magic"
            )
        raise Rejected(
            "bad magic",
            f"{peer}: expected control magic {CHANNEL_MAGIC_CONTROL.hex()}, got {magic.hex()}",
        )
    coord_nonce = secrets.token_bytes(NONCE_LEN)
    # The Challenge is sealed with the salt itself: a relay of another session fails right here.
    sealer = RecordSealer(bytes(salt), COORD_TO_RELAY)
    challenge = sealer.seal(RecordKind.CONTROL, 0, encode(Challenge(coord_nonce)))
    try:
        await stream.send_all(challenge)
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        raise Rejected("connection error", f"{peer}: sending Challenge: {exc!r}") from None
    key = hs_key(salt, coord_nonce)
    # The ceiling is fitted to the largest legal Hello (wire.max_hello_payload): a stranger
    # cannot make us buffer more than that before the MAC.
    opener = RecordOpener(key, RELAY_TO_COORD, max_payload=max_hello)
    try:
        rec = await read_record(stream, opener, what=f"Hello from {peer}")
    except AuthError as exc:
        raise Rejected("bad mac", f"{peer}: {exc}") from None
    except FrameTooLarge as exc:
        raise Rejected("malformed", f"{peer}: {exc}") from None
    except WireError as exc:
        text = str(exc)
        category = "eof before hello" if "closed" in text else "malformed"
        raise Rejected(category, f"{peer}: {exc}") from None
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        raise Rejected("connection error", f"{peer}: {exc!r}") from None
    if rec.kind != RecordKind.CONTROL:
        raise Rejected(
            "malformed", f"{peer}: expected a CONTROL record with Hello, got record kind {rec.kind}"
        )
    try:
        msg = decode_relay(rec.payload)
    except WireError as exc:
        raise Rejected("malformed", f"{peer}: {exc}") from None
    if not isinstance(msg, Hello):
        raise Rejected("malformed", f"{peer}: expected Hello, got {type(msg).__name__}")
    sealer.rekey(key)
    return AuthenticatedHello(msg, coord_nonce, sealer, opener)


def switch_to_connection_keys(auth: AuthenticatedHello, salt: SessionSalt) -> None:
    """After HelloAck: both directions move to ``conn_key``; sequence numbers keep counting."""
    key = conn_key(salt, auth.coord_nonce, auth.hello.nonce)
    auth.sealer.rekey(key)
    auth.opener.rekey(key)
    auth.opener.max_payload = MAX_RECORD_PAYLOAD


async def relay_handshake(
    stream: trio.abc.Stream, salt: SessionSalt, *, host: str, ranks: tuple[int, ...],
    coordinator: str,
) -> tuple[RecordSealer, RecordOpener]:
    """The relay side (SPEC §2.6): magic, verify Challenge, Hello, verify HelloAck, rekey.

    The caller bounds it by ``handshake_timeout``.

    Raises:
        AuthError: the coordinator is of another session, or its HelloAck does not echo us.
        WireError: EOF or a malformed record (the caller may re-dial).
    """
    await stream.send_all(CHANNEL_MAGIC_CONTROL)
    opener = RecordOpener(bytes(salt), COORD_TO_RELAY,
                          max_payload=MAX_HANDSHAKE_PAYLOAD)
    try:
        rec = await read_record(stream, opener, what=f"Challenge from {coordinator}")
    except AuthError as exc:
        raise AuthError(
            f"relay {host!r}: the coordinator at {coordinator} is not of this session "
            f"(Challenge did not verify with our salt): {exc}"
        ) from None
    challenge = decode_relay(rec.payload) if rec.kind == RecordKind.CONTROL else None
    if not isinstance(challenge, Challenge):
        raise WireError(f"relay {host!r}: expected Challenge from {coordinator}, got "
                        f"{type(challenge).__name__ if challenge else f'kind {rec.kind}'}")
    key = hs_key(salt, challenge.nonce)
    sealer = RecordSealer(key, RELAY_TO_COORD)
    relay_nonce = secrets.token_bytes(NONCE_LEN)
    hello = Hello(host=host, ranks=ranks, nonce=relay_nonce)
    await stream.send_all(sealer.seal(RecordKind.CONTROL, 0, encode(hello)))
    opener.rekey(key)
    rec = await read_record(stream, opener, what=f"HelloAck from {coordinator}")
    ack = decode_relay(rec.payload) if rec.kind == RecordKind.CONTROL else None
    if not isinstance(ack, HelloAck):
        raise WireError(f"relay {host!r}: expected HelloAck from {coordinator}, got "
                        f"{type(ack).__name__ if ack else f'kind {rec.kind}'}")
    if not hmac.compare_digest(ack.nonce, relay_nonce):
        raise AuthError(f"relay {host!r}: HelloAck from {coordinator} does not echo our "
                        "nonce (replayed coordinator records?)")
    final = conn_key(salt, challenge.nonce, relay_nonce)
    sealer.rekey(final)
    opener.rekey(final)
    opener.max_payload = MAX_RECORD_PAYLOAD
    return sealer, opener
