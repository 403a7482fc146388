"""Strict CBOR loading for FT/1 payloads (SPEC §2.7): one item, no tags, no indefinite lengths,
no duplicate map keys, nesting of at most 16, nothing after the item."""

from __future__ import annotations

import io
from typing import Any

import cbor2

from .._errors import WireError

MAX_DEPTH = 16

# Payloads above this size are not left referenced by the per-thread decoder between calls.
_RETAIN_LIMIT = 1 << 16


class _DenyTags(dict[int, Any]):
    """A semantic-decoder table that claims every tag, so cbor2 decodes none natively."""

    def __contains__(self, key: object) -> bool:
        return True

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key]

    def __getitem__(self, key: int) -> Any:
        # cbor2 6.x calls semantic decoders as (value, immutable); accept any signature so
        # the refusal itself never fails with a TypeError that hides the real reason.
        def refuse(*_args: Any) -> Any:
            raise WireError(f"CBOR tag {key} is not allowed in FT/1 payloads")

        return refuse


_DENY_TAGS = _DenyTags()


def _refuse_tag(*args: Any) -> Any:
    # cbor2 6.x calls tag hooks as (tag, immutable), older versions as (decoder, tag).
    tag = next((a for a in args if isinstance(a, cbor2.CBORTag)), None)
    number = "?" if tag is None else tag.tag
    raise WireError(f"CBOR tag {number} is not allowed in FT/1 payloads")


_EMPTY = b""
_REFILL = io.BytesIO.__init__  # re-initialising a BytesIO points it at new bytes, no copy


class _Reader:
    """A strict decoder and the file it reads from, reused from payload to payload.

    ``cbor2.loads`` cannot tell where the item ended (it ignores trailing bytes), so strict loading
    needs a decoder over a file and the file's ``tell()``; building a decoder and a file per
    payload costs more than decoding a small payload. A reader is refilled instead. That is sound
    because a decode that returns leaves the decoder with no read-ahead (it seeks the file back to
    the end of the item), and after a decode that raised, :meth:`reset` drops the read-ahead.
    """

    __slots__ = ("decoder", "fp")

    def __init__(self) -> None:
        self.fp = io.BytesIO()
        self.decoder = cbor2.CBORDecoder(
            self.fp,
            tag_hook=_refuse_tag,
            semantic_decoders=_DENY_TAGS,
            allow_indefinite=False,
            allow_duplicate_keys=False,
            max_depth=MAX_DEPTH,
        )

    def reset(self) -> None:
        _REFILL(self.fp, _EMPTY)
        self.decoder.fp = self.fp  # assigning fp discards the decoder's read-ahead buffer


# Idle readers. A pool rather than one reader so that two threads (or a decode nested in another
# through a hook) never share one; list.pop/append are atomic. It holds no state of any run.
_IDLE: list[_Reader] = []


def cbor_loads(data: bytes | bytearray | memoryview, what: str) -> Any:
    """Strictly decode exactly one CBOR item.

    Raises:
        WireError: malformed CBOR, tags, indefinite lengths, duplicate map keys, nesting deeper
            than 16, or trailing bytes; the message names ``what`` was being decoded.
    """
    if type(data) is not bytes:
        data = bytes(data)
    reader = _IDLE.pop() if _IDLE else _Reader()
    fp = reader.fp
    decoded = False
    try:
        _REFILL(fp, data)
        value = reader.decoder.decode()
        end = fp.tell()
        decoded = True
    except WireError as exc:
        raise WireError(f"{what}: {exc}") from None
    except (cbor2.CBORError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, WireError) else exc
        raise WireError(f"{what}: invalid CBOR payload ({cause})") from None
    finally:
        if not decoded or len(data) > _RETAIN_LIMIT:
            # Drop the read-ahead of a failed decode; do not keep a large payload alive.
            reader.reset()
        _IDLE.append(reader)
    if end != len(data):
        raise WireError(
            f"{what}: expected exactly one CBOR item, got {len(data) - end} trailing "
            f"byte(s) after it"
        )
    if type(value) is not list and (
        isinstance(value, cbor2.CBORSimpleValue) or value is cbor2.undefined
    ):
        raise WireError(f"{what}: expected a CBOR array, got a simple value")
    return value


def cbor_dumps(value: Any) -> bytes:
    return cbor2.dumps(value)
