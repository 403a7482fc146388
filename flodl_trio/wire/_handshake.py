"""The upstream handshake (SPEC §2.6, FT/2) as two sans-IO state machines, one per end.

Learnt from h11's ``Connection``: the caller feeds received bytes with ``receive_data`` (``b""``
is EOF), asks ``next_event()`` what they amount to, and writes whatever ``data_to_send()``
returns. No socket, no clock: the caller owns both, and the deadlines with them. Every failure
is a :class:`~flodl_trio.WireError` (``AuthError`` for a MAC, ``FrameTooLarge`` for a declared
length) or a :class:`~flodl_trio.HandshakeError`; a machine that failed is poisoned and raises
the same error again.

FT/2 confirms the join on both sides. The relay answers a verified ``HelloAck`` with ``Ready``;
the coordinator's machine is established only once ``Ready`` verified, and its first record
after that is a *welcome*: one FANOUT of ``CoordHeartbeat`` to the relay's ranks. The relay's
machine is established only once that first record arrived. So each side knows the other has
counted the join, and a connection that ends before that is, for both, a failed attempt (the
coordinator un-covers the relay; the relay re-dials).

A relay that re-dials a durable coordinator it had joined sends ``Resume`` (the Hello's fields and
the highest coordinator generation it saw) where ``Hello`` goes; the coordinator's machine says
which it was (:attr:`HelloReceived.resume`). A coordinator that runs with a session store is
built with its ``generation`` and sends ``Generation{g}`` as its first record after ``Ready``,
just before the welcome; a relay that already saw a higher generation fails the attempt (a
deposed coordinator's) before any record of it is delivered.

A coordinator that authenticated the Hello and will not take the relay answers ``Refused``
where ``HelloAck`` would go (``refuse()``) and closes; the relay's machine then ends in
:class:`RefusalReceived`, which no re-dial can change.

The handshake ends in :class:`Established`: the sealer/opener pair, rekeyed to ``conn_key``,
with the opener still holding whatever arrived past the handshake (``opener.feed(b"")`` opens
it) and, on the relay, the records already opened (the welcome).
"""

from __future__ import annotations

import secrets
from typing import Final

import attrs

from .._errors import AuthError, FlodlError, HandshakeError, WireError
from ._constants import (
    CHANNEL_MAGIC_CONTROL,
    CHANNEL_MAGIC_DATA,
    CHANNEL_MAGIC_JOIN,
    CHANNEL_MAGIC_RENDEZVOUS,
    COORD_TO_RELAY,
    MAX_RECORD_PAYLOAD,
    NONCE_LEN,
    RELAY_TO_COORD,
    RecordKind,
)
from ._crypto import SessionSalt, conn_key, hs_key, shared_mac
from ._frames import encode_frame
from ._messages import (
    Cadence,
    Challenge,
    CoordHeartbeat,
    Generation,
    Hello,
    HelloAck,
    Ready,
    Refused,
    RelayControlMsg,
    Resume,
    decode_relay,
    encode,
)
from ._msg_relay import cadence_problem
from ._records import Record, RecordOpener, RecordSealer, encode_fanout

# A Hello is small; a stranger must not make the coordinator buffer megabytes before the MAC.
MAX_HANDSHAKE_PAYLOAD = 256 * 1024
# A Refused's reason is clipped to this many characters: it ends up on one line of a console.
MAX_REFUSAL_REASON = 1024
# Said in a reject that looks like a relay whose session salt differs: it hung up on our
# Challenge (which it cannot verify), or its Hello failed its MAC.
WRONG_SALT_HINT: Final = "wrong salt?"

_OTHER_LEGS = {
    CHANNEL_MAGIC_DATA: "data",
    CHANNEL_MAGIC_RENDEZVOUS: "rendezvous",
    CHANNEL_MAGIC_JOIN: "join",
}


class NeedData:
    """``next_event()`` needs more bytes (or EOF) before it can say anything."""

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = NeedData()


@attrs.frozen
class HelloReceived:
    """Coordinator side: an authenticated ``Hello`` or ``Resume``; answer with ``accept()`` or
    ``refuse()``.

    Attributes:
        hello: the relay's identity (for a ``Resume``, its Hello fields).
        resume: the ``Resume`` itself when the relay resumes, else None.
    """

    hello: Hello
    resume: Resume | None = None

    @property
    def resumed(self) -> bool:
        """True when the relay sent ``Resume`` (it had joined a durable coordinator)."""
        return self.resume is not None

    @property
    def generation(self) -> int | None:
        """The highest coordinator generation the resuming relay saw; None for a ``Hello``."""
        return None if self.resume is None else int(self.resume.generation)


@attrs.frozen
class RefusalReceived:
    """Relay side: the coordinator authenticated our ``Hello`` and refused it with a verified
    ``Refused`` that echoes our nonce; it closes the connection. Re-dialing cannot help."""

    reason: str


@attrs.frozen
class Established:
    """The handshake is done: records from here on use this pair (``conn_key``).

    ``records``: records already opened past the handshake (the relay's: the coordinator's
    welcome), to be handled before anything the opener still holds. ``generation``: the
    coordinator's generation (its ``Generation`` record), None if it runs without a store.
    """

    sealer: RecordSealer
    opener: RecordOpener
    records: tuple[Record, ...] = ()
    generation: int | None = None


HandshakeEvent = NeedData | HelloReceived | RefusalReceived | Established


class UpstreamMachine:
    """What both ends share: buffered output, EOF, and poisoning."""

    def __init__(self) -> None:
        self._out = bytearray()
        self._eof = False
        self._error: FlodlError | None = None
        self._done = False
        self.failure_category: str | None = None

    def data_to_send(self) -> bytes:
        """The bytes to write now (possibly empty); each call returns them once."""
        out = bytes(self._out)
        self._out.clear()
        return out

    def _fail(self, category: str, exc: FlodlError) -> FlodlError:
        self._error = exc
        self.failure_category = category
        return exc

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _next_record(self, opener: RecordOpener, what: str, eof_category: str) -> Record | None:
        """The next record, or None if more bytes are needed; an EOF now is an error."""
        try:
            rec = opener.next_record()
        except AuthError as exc:
            raise self._fail("bad mac", AuthError(f"{what}: {exc}")) from None
        except WireError as exc:
            # FrameTooLarge stays itself: the declared length was refused from the header.
            raise self._fail("malformed", type(exc)(f"{what}: {exc}")) from None
        if rec is None and self._eof:
            err = opener.eof_error(what) or WireError(
                f"{what}: peer closed the connection before the record arrived")
            raise self._fail(eof_category, err)
        return rec

    def _control(self, rec: Record, expected: tuple[type[RelayControlMsg], ...],
                 what: str) -> RelayControlMsg:
        names = " or ".join(cls.__name__ for cls in expected)
        if rec.kind != RecordKind.CONTROL:
            raise self._fail("malformed", WireError(
                f"{what}: expected a CONTROL record with {names}, got record kind {rec.kind}"))
        try:
            msg = decode_relay(rec.payload)
        except WireError as exc:
            raise self._fail("malformed", WireError(f"{what}: {exc}")) from None
        if not isinstance(msg, expected):
            raise self._fail("malformed", WireError(
                f"{what}: expected {names}, got {type(msg).__name__}"))
        return msg


_HEARTBEATS: dict[SessionSalt, bytes] = {}


def _heartbeat_frame(salt: SessionSalt) -> bytes:
    """The welcome's ``CoordHeartbeat`` frame: the same bytes for every relay of a session (a
    ControlFrame has no nonce), so it is sealed once per salt."""
    frame = _HEARTBEATS.get(salt)
    if frame is None:
        if len(_HEARTBEATS) >= 16:
            _HEARTBEATS.clear()
        frame = _HEARTBEATS[salt] = encode_frame(salt, CoordHeartbeat())
    return frame


class CoordinatorHandshake(UpstreamMachine):
    """The coordinator's end: magic, ``Challenge``, authenticated ``Hello``, ``HelloAck``.

    Events: ``HelloReceived`` once the Hello's (or Resume's) MAC verified (the caller validates
    it against the world and calls :meth:`accept`, or :meth:`refuse` and closes), then
    ``Established`` once the relay's ``Ready`` verified (``Generation`` when ``generation`` is
    given, then the welcome record and the ``Cadence`` given to :meth:`accept`, are then
    queued). ``failure_category``
    groups a failure for reject reports (``"bad magic"``, ``"bad mac"``, ``"eof before
    hello"``, ...).

    Args:
        salt: the run's session salt.
        peer: the peer's address, named in every error.
        max_hello: the pre-auth ceiling on the Hello's payload.
        max_record_payload: the ceiling once the relay is acknowledged.
        generation: the coordinator's generation when it runs with a session store: sent as
            ``Generation`` before the welcome. None (no store): no ``Generation``.
    """

    def __init__(self, salt: SessionSalt, *, peer: str, max_hello: int = MAX_HANDSHAKE_PAYLOAD,
                 max_record_payload: int = MAX_RECORD_PAYLOAD,
                 generation: int | None = None) -> None:
        super().__init__()
        if generation is not None:
            # Checked now, not when the first relay has already sent its Ready.
            encode(Generation(generation))
        self.peer = peer
        self.generation = generation
        self._salt = salt
        self._max_record_payload = max_record_payload
        self._magic = bytearray()
        self.coord_nonce = secrets.token_bytes(NONCE_LEN)
        self._hs_key = hs_key(salt, self.coord_nonce)
        # The Challenge is sealed with the salt itself: a relay of another session fails there
        # (its MAC state keyed once per process: shared_mac).
        shared_mac(salt)
        self._sealer = RecordSealer(bytes(salt), COORD_TO_RELAY)
        self._opener = RecordOpener(self._hs_key, RELAY_TO_COORD, max_payload=max_hello)
        self._state = "magic"
        self.hello: Hello | None = None
        self.resume: Resume | None = None
        # The failure looks like a relay whose session salt differs (WRONG_SALT_HINT).
        self.salt_suspect = False
        self._cadence = b""  # accept(cadence=): sealed after the welcome

    @property
    def sealer(self) -> RecordSealer:
        """This end's sealer (rekeyed in place as the handshake moves on)."""
        return self._sealer

    @property
    def opener(self) -> RecordOpener:
        """This end's opener (rekeyed in place; holds what arrived past the handshake)."""
        return self._opener

    @property
    def authenticated(self) -> bool:
        """True once a Hello verified (failures from then on are not pre-auth rejects)."""
        return self.hello is not None

    def receive_data(self, data: bytes) -> None:
        """Feed received bytes; ``b""`` means the peer closed its side."""
        self._check()
        if not data:
            self._eof = True
        elif self._state == "magic":
            need = len(CHANNEL_MAGIC_CONTROL) - len(self._magic)
            self._magic += data[:need]
            if len(data) > need:
                self._opener.push(data[need:])
        else:
            self._opener.push(data)

    def next_event(self) -> HandshakeEvent:
        """What the bytes so far amount to.

        Raises:
            WireError / AuthError / HandshakeError: the handshake failed (see
                ``failure_category``); the machine is poisoned.
        """
        self._check()
        if self._state == "magic" and not self._take_magic():
            return NEED_DATA
        if self._state == "hello":
            rec = self._next_hello()
            if rec is None:
                return NEED_DATA
            msg = self._control(rec, (Hello, Resume), f"Hello from {self.peer}")
            if isinstance(msg, Resume):
                self.resume = msg
                hello = Hello(host=msg.host, world_size=msg.world_size,
                              model_sigs=msg.model_sigs, ranks=msg.ranks, nonce=msg.nonce)
            else:
                assert isinstance(msg, Hello)
                hello = msg
            self.hello = hello
            self._sealer.rekey(self._opener.mac)  # hs_key, keyed once
            self._state = "decide"
            return HelloReceived(hello, self.resume)
        if self._state == "decide":
            return NEED_DATA
        if self._state == "acked":
            assert self.hello is not None
            host = self.hello.host
            what = f"Ready from relay {host!r} at {self.peer}"
            rec = self._next_record(self._opener, what, "eof before ready")
            if rec is None:
                return NEED_DATA
            self._control(rec, (Ready,), what)
            if self.generation is not None:
                # First, so the relay can fail a deposed coordinator before any record of it.
                gen = Generation(self.generation)
                self._out += self._sealer.seal(RecordKind.CONTROL, 0, encode(gen))
            # The welcome confirms the join to the relay: it is established only once a
            # record arrives after its Ready.
            welcome = encode_fanout(self.hello.ranks, _heartbeat_frame(self._salt))
            self._out += self._sealer.seal(RecordKind.FANOUT, 0, welcome)
            if self._cadence:
                self._out += self._sealer.seal(RecordKind.CONTROL, 0, self._cadence)
            self._state = "done"
            self._done = True
            return Established(self._sealer, self._opener, generation=self.generation)
        raise HandshakeError(f"{self.peer}: the upstream handshake already ended")

    def _next_hello(self) -> Record | None:
        """The Hello's record (None: more bytes needed); a failure that looks like a salt that
        differs says so (:data:`WRONG_SALT_HINT`, :attr:`salt_suspect`)."""
        what = f"Hello from {self.peer}"
        try:
            return self._next_record(self._opener, what, "eof before hello")
        except AuthError as exc:  # the Hello's MAC: the key is derived from the salt
            self.salt_suspect = True
            raise self._fail("bad mac", AuthError(f"{exc} ({WRONG_SALT_HINT})")) from None
        except WireError as exc:
            if self.failure_category != "eof before hello" or self._opener.buffered:
                raise
            # Not one byte of a Hello: a relay of this protocol whose salt differs cannot
            # verify our Challenge and hangs up right there.
            self.salt_suspect = True
            raise self._fail("eof before hello", WireError(
                f"{what}: the relay closed the connection after its magic without sending a "
                f"Hello (a relay whose session salt differs hangs up on our Challenge: "
                f"{WRONG_SALT_HINT})")) from exc

    def accept(self, *, cadence: Cadence | None = None) -> None:
        """Answer the Hello (or Resume) with ``HelloAck`` and switch both directions to
        ``conn_key``; the machine then waits for the relay's ``Ready`` (FT/2).

        ``cadence``: a ``Cadence`` sealed right after the welcome, in the same write (a
        coordinator that paces its relays tells a joining relay its period without a write
        of its own).

        Raises:
            HandshakeError: no authenticated Hello awaits an answer.
            WireError: ``cadence``'s interval is not one a relay accepts.
        """
        self._check()
        if self._state != "decide" or self.hello is None:
            raise HandshakeError(f"{self.peer}: accept() before an authenticated Hello")
        if cadence is not None:
            if (problem := cadence_problem(cadence.interval)) is not None:
                raise WireError(f"Cadence to {self.peer}: {problem}")
            self._cadence = encode(cadence)
        ack = HelloAck(self.hello.nonce)
        self._out += self._sealer.seal(RecordKind.CONTROL, 0, encode(ack))
        key = conn_key(self._salt, self.coord_nonce, self.hello.nonce)
        self._sealer.rekey(key)
        self._opener.rekey(self._sealer.mac, max_payload=self._max_record_payload)
        self._state = "acked"

    @property
    def refusable(self) -> bool:
        """True while an authenticated Hello awaits ``accept()`` or ``refuse()``."""
        return self._state == "decide" and self._error is None

    def refuse(self, reason: str) -> None:
        """Answer the Hello (or Resume) with ``Refused{nonce, reason}`` instead of ``HelloAck``:
        same key (``hs_key``), seq and direction, echoing the relay's nonce. The caller writes
        it and closes the connection; the machine has ended. ``reason`` is clipped to
        ``MAX_REFUSAL_REASON`` characters."""
        self._check()
        if self._state != "decide" or self.hello is None:
            raise HandshakeError(f"{self.peer}: refuse() before an authenticated Hello")
        if len(reason) > MAX_REFUSAL_REASON:
            reason = reason[:MAX_REFUSAL_REASON - 3] + "..."
        refused = Refused(nonce=self.hello.nonce, reason=reason)
        self._out += self._sealer.seal(RecordKind.CONTROL, 0, encode(refused))
        self._state = "refused"

    def _take_magic(self) -> bool:
        magic = bytes(self._magic)
        if len(magic) < len(CHANNEL_MAGIC_CONTROL):
            if self._eof:
                raise self._fail("eof before magic", WireError(
                    f"handshake from {self.peer}: peer closed the connection after "
                    f"{len(magic)} of 4 magic bytes"))
            return False
        if magic != CHANNEL_MAGIC_CONTROL:
            leg = _OTHER_LEGS.get(magic)
            if leg is not None:
                raise self._fail("wrong leg", HandshakeError(
                    f"{self.peer}: expected the control magic, got the {leg} leg's magic"))
            raise self._fail("bad magic", HandshakeError(
                f"{self.peer}: expected control magic {CHANNEL_MAGIC_CONTROL.hex()}, got "
                f"{magic.hex()}"))
        self._out += self._sealer.seal(RecordKind.CONTROL, 0, encode(Challenge(self.coord_nonce)))
        self._state = "hello"
        return True


__all__ = [
    "MAX_HANDSHAKE_PAYLOAD",
    "MAX_REFUSAL_REASON",
    "NEED_DATA",
    "WRONG_SALT_HINT",
    "CoordinatorHandshake",
    "Established",
    "HandshakeEvent",
    "HelloReceived",
    "NeedData",
    "RefusalReceived",
]
