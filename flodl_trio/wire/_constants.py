"""FT/2 constants: magics, protocol version, ceilings, kinds (SPEC §2)."""

from __future__ import annotations

import enum
import struct

PROTOCOL_VERSION = 0x4654_0002  # "FT" 2 (FT/1: no world size in Hello, no confirmed join)

# Channel-select magic, the first 4 bytes of every connection to the coordinator port.
CHANNEL_MAGIC_RENDEZVOUS = struct.pack("<I", 0xF10D17E0)
CHANNEL_MAGIC_DATA = struct.pack("<I", 0xF10D17E1)
CHANNEL_MAGIC_CONTROL = struct.pack("<I", 0xF10D17E2)
CHANNEL_MAGIC_JOIN = struct.pack("<I", 0xF10D17E3)
STATUS_PREFIXES = (b"GET ", b"POST")

RANK_HELLO_MAGIC = 0xF10D17C2
RANK_ACK_MAGIC = 0xF10D17C3
CONTROL_FRAME_MAGIC = 0xF10D17C4
RECORD_MAGIC = 0xF10D17D0

RANK_HELLO_LEN = 24
RANK_ACK_LEN = 16
FRAME_HEADER_LEN = 24
RECORD_HEADER_LEN = 25
LEN_PREFIX_LEN = 4

MAX_CONTROL_PAYLOAD = 16 * 1024 * 1024
MAX_RECORD_PAYLOAD = 64 * 1024 * 1024
# A length-framed blob on the loopback leg is one whole ControlFrame.
MAX_LEN_FRAME = MAX_CONTROL_PAYLOAD + FRAME_HEADER_LEN

NONCE_LEN = 16

# Direction bytes mixed into every record tag, so a record cannot be reflected back.
RELAY_TO_COORD = 0x01
COORD_TO_RELAY = 0x02


class MsgKind(enum.IntEnum):
    """Kind of a ControlFrame (SPEC §2.4)."""

    CONTROL = 1
    TIMING = 2
    METRICS = 3
    RESERVED_4 = 4
    RESERVED_5 = 5
    RENDEZVOUS = 6
    JOIN = 7


class RecordKind(enum.IntEnum):
    """Kind of a MuxRecord on the relay ↔ coordinator leg (SPEC §2.5)."""

    DATA = 1
    CONTROL = 2
    HOST_FRAME = 3  # reserved for the data leg
    BROADCAST = 4  # reserved for the data leg
    FANOUT = 5


def u32_magic_hex(value: int) -> str:
    return f"0x{value:08X}"
