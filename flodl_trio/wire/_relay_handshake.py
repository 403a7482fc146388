"""The relay's end of the upstream handshake (SPEC §2.6, FT/2), sans-IO like the coordinator's
(:mod:`._handshake`, which describes both): verify ``Challenge``, send ``Hello`` (or ``Resume``),
verify ``HelloAck`` (or ``Refused``), send ``Ready``, take the coordinator's ``Generation`` if it
sends one, wait for the welcome."""

from __future__ import annotations

import secrets
from hmac import compare_digest

from .._errors import AuthError, HandshakeError, WireError
from ._constants import (
    CHANNEL_MAGIC_CONTROL,
    COORD_TO_RELAY,
    MAX_RECORD_PAYLOAD,
    NONCE_LEN,
    RELAY_TO_COORD,
    RecordKind,
)
from ._crypto import SessionSalt, conn_key, hs_key, shared_mac
from ._handshake import (
    MAX_HANDSHAKE_PAYLOAD,
    NEED_DATA,
    Established,
    HandshakeEvent,
    NeedData,
    RefusalReceived,
    UpstreamMachine,
)
from ._messages import (
    Challenge,
    Generation,
    Hello,
    HelloAck,
    Ready,
    Refused,
    Resume,
    encode,
)
from ._records import RecordOpener, RecordSealer


class RelayHandshake(UpstreamMachine):
    """The relay's end: magic, verify ``Challenge``, ``Hello``, verify ``HelloAck``, ``Ready``,
    then wait for the coordinator's first record (its welcome) before ``Established``.

    The Hello is sent exactly as given (tests send unsorted or empty rank lists on purpose).

    A coordinator that runs with a session store sends ``Generation{g}`` before its welcome:
    ``coordinator_generation`` then holds ``g`` (and ``Established.generation``). Given
    ``generation`` (the highest coordinator generation this relay saw: it re-dials a durable
    coordinator it had joined), the machine sends ``Resume`` instead of ``Hello``, and fails
    the attempt (``failure_category`` ``"deposed"``) when the coordinator's generation is lower
    than that, or when it sends none: a deposed coordinator, whose records are never delivered.

    Args:
        salt: the run's session salt.
        host / ranks / world_size / model_sigs: the Hello's fields.
        coordinator: the coordinator's address, named in every error.
        max_record_payload: the ceiling once acknowledged.
        generation: None to join (``Hello``); the highest generation seen to resume
            (``Resume``).
    """

    def __init__(self, salt: SessionSalt, *, host: str, ranks: tuple[int, ...],
                 world_size: int, coordinator: str,
                 model_sigs: dict[str, bytes] | None = None,
                 max_record_payload: int = MAX_RECORD_PAYLOAD,
                 generation: int | None = None) -> None:
        super().__init__()
        self.generation = generation
        self.coordinator_generation: int | None = None
        self.host = host
        self.coordinator = coordinator
        self._salt = salt
        self._ranks = ranks
        self._world_size = world_size
        self._model_sigs = dict(model_sigs or {})
        self._max_record_payload = max_record_payload
        self.relay_nonce = secrets.token_bytes(NONCE_LEN)
        self._coord_nonce = b""
        shared_mac(salt)  # the Challenge's MAC state, keyed once per process
        self._opener = RecordOpener(bytes(salt), COORD_TO_RELAY, max_payload=MAX_HANDSHAKE_PAYLOAD)
        self._sealer: RecordSealer | None = None
        self._state = "challenge"
        self._out += CHANNEL_MAGIC_CONTROL

    @property
    def sealer(self) -> RecordSealer | None:
        """This end's sealer once the Challenge verified (rekeyed in place), else None."""
        return self._sealer

    @property
    def opener(self) -> RecordOpener:
        """This end's opener (rekeyed in place; holds what arrived past the handshake)."""
        return self._opener

    def receive_data(self, data: bytes) -> None:
        """Feed received bytes; ``b""`` means the coordinator closed its side."""
        self._check()
        if not data:
            self._eof = True
        else:
            self._opener.push(data)

    def next_event(self) -> HandshakeEvent:
        """What the bytes so far amount to.

        Events: ``RefusalReceived`` when the coordinator refused our Hello (a verified
        ``Refused`` that echoes us), else ``Established`` once the welcome arrived.

        Raises:
            AuthError: the coordinator is of another session (``failure_category`` is then
                ``"wrong salt"``), or its HelloAck / Refused does not echo us.
            WireError: EOF or a malformed record. The machine is poisoned either way.
        """
        self._check()
        if self._state == "challenge" and not self._answer_challenge():
            return NEED_DATA
        if self._state == "ack" and (answer := self._take_ack()) is not None:
            return answer
        if self._state == "welcome":
            return self._take_welcome()
        raise HandshakeError(f"relay {self.host!r}: the upstream handshake already ended")

    def _answer_challenge(self) -> bool:
        """Verify the coordinator's ``Challenge`` and queue our ``Hello`` (or ``Resume``) under
        the handshake key; False while the Challenge has not all arrived."""
        try:
            rec = self._next_record(self._opener, f"Challenge from {self.coordinator}",
                                    "eof before challenge")
        except AuthError as exc:
            # Its own category: the relay gives up after a few of these in a row.
            raise self._fail("wrong salt", AuthError(
                f"relay {self.host!r}: the coordinator at {self.coordinator} is not of this "
                f"session (Challenge did not verify with our salt): {exc}")) from None
        if rec is None:
            return False
        challenge = self._control(rec, (Challenge,), f"relay {self.host!r}: from "
                                  f"{self.coordinator}")
        assert isinstance(challenge, Challenge)
        self._coord_nonce = challenge.nonce
        key = hs_key(self._salt, challenge.nonce)
        self._sealer = RecordSealer(key, RELAY_TO_COORD)
        self._out += self._sealer.seal(RecordKind.CONTROL, 0, encode(self._hello()))
        self._opener.rekey(self._sealer.mac)  # hs_key, keyed once
        self._state = "ack"
        return True

    def _hello(self) -> Hello | Resume:
        """``Hello`` to join; ``Resume`` (the same fields and the generation seen) to resume."""
        if self.generation is None:
            return Hello(host=self.host, world_size=self._world_size,
                         model_sigs=self._model_sigs, ranks=self._ranks, nonce=self.relay_nonce)
        return Resume(host=self.host, world_size=self._world_size, model_sigs=self._model_sigs,
                      ranks=self._ranks, nonce=self.relay_nonce, generation=self.generation)

    def _take_ack(self) -> NeedData | RefusalReceived | None:
        """Verify ``HelloAck`` and answer ``Ready`` under the connection key (None: go on to
        the welcome), or take a ``Refused``; NEED_DATA while the answer has not all arrived."""
        who = f"relay {self.host!r}"
        rec = self._next_record(self._opener, f"{who}: HelloAck or Refused from "
                                f"{self.coordinator}", "eof before helloack")
        if rec is None:
            return NEED_DATA
        ack = self._control(rec, (HelloAck, Refused), f"{who}: from {self.coordinator}")
        assert isinstance(ack, HelloAck | Refused) and self._sealer is not None
        if not compare_digest(ack.nonce, self.relay_nonce):
            raise self._fail("bad echo", AuthError(
                f"{who}: {type(ack).__name__} from {self.coordinator} does not echo our "
                "nonce (replayed coordinator records?)"))
        if isinstance(ack, Refused):
            self._state = "refused"
            return RefusalReceived(ack.reason)
        final = conn_key(self._salt, self._coord_nonce, self.relay_nonce)
        self._sealer.rekey(final)
        self._opener.rekey(self._sealer.mac, max_payload=self._max_record_payload)
        self._out += self._sealer.seal(RecordKind.CONTROL, 0, encode(Ready()))
        self._state = "welcome"
        return None

    def _take_welcome(self) -> HandshakeEvent:
        """``Established`` once the coordinator's first record after our ``Ready`` arrived
        (a durable coordinator's ``Generation`` comes just before it); else NEED_DATA."""
        # The coordinator counts us only once it verified Ready; its first record after
        # that says it did. A connection that ends before it is a failed attempt.
        who = f"relay {self.host!r}"
        assert self._sealer is not None
        while True:
            rec = self._next_record(self._opener, f"{who}: the welcome from "
                                    f"{self.coordinator} after Ready", "eof before welcome")
            if rec is None:
                return NEED_DATA
            if rec.kind != RecordKind.CONTROL:
                break
            msg = self._control(rec, (Generation,), f"{who}: before the welcome from "
                                f"{self.coordinator}")
            assert isinstance(msg, Generation)
            if self.coordinator_generation is not None:
                raise self._fail("malformed", WireError(
                    f"{who}: a second Generation ({msg.generation}) before the welcome "
                    f"from {self.coordinator}"))
            self.coordinator_generation = int(msg.generation)
            self._check_generation()
        self._check_generation()
        self._state = "done"
        self._done = True
        return Established(self._sealer, self._opener, (rec,),
                           generation=self.coordinator_generation)

    def _check_generation(self) -> None:
        """Fail the attempt if the coordinator is older than one this relay already saw."""
        seen = self.generation
        got = self.coordinator_generation
        if seen is None or (got is not None and got >= seen):
            return
        shown = f"{got}" if got is not None else "0 (it sent no Generation)"
        raise self._fail("deposed", HandshakeError(
            f"relay {self.host!r}: generation {shown} < {seen} already seen: a deposed "
            f"coordinator at {self.coordinator}"))


__all__ = ["RelayHandshake"]
