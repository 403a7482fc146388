"""A handshake ends by switching both directions to the connection key and, on the receiving
side, from the small pre-auth ceiling to the connection's own: ``rekey(key, max_payload=)``."""

from __future__ import annotations

import pytest

from flodl_trio import wire
from flodl_trio._errors import FrameTooLarge

HS_KEY = b"H" * 32
CONN_KEY = b"C" * 32
BIG = bytes(wire.MAX_HANDSHAKE_PAYLOAD + 1)


def test_an_opener_rekeyed_with_a_ceiling_opens_what_the_handshake_ceiling_refused() -> None:
    sealer = wire.RecordSealer(CONN_KEY, wire.COORD_TO_RELAY)
    before = wire.RecordOpener(HS_KEY, wire.COORD_TO_RELAY,
                               max_payload=wire.MAX_HANDSHAKE_PAYLOAD)
    with pytest.raises(FrameTooLarge, match=r"over the ceiling of 262144"):
        before.feed(sealer.seal(wire.RecordKind.CONTROL, 0, BIG))

    sealer = wire.RecordSealer(CONN_KEY, wire.COORD_TO_RELAY)
    opener = wire.RecordOpener(HS_KEY, wire.COORD_TO_RELAY,
                               max_payload=wire.MAX_HANDSHAKE_PAYLOAD)
    opener.rekey(CONN_KEY, max_payload=wire.MAX_RECORD_PAYLOAD)
    assert opener.max_payload == wire.MAX_RECORD_PAYLOAD
    assert opener.feed(sealer.seal(wire.RecordKind.CONTROL, 0, BIG)) == [
        wire.Record(wire.RecordKind.CONTROL, 0, BIG)]
    opener.rekey(HS_KEY)  # a later switch of keys alone keeps the connection's ceiling
    assert opener.max_payload == wire.MAX_RECORD_PAYLOAD

