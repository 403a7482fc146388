"""How large a legal Hello can be (SPEC §2.7), so the coordinator buffers no more than that before
the MAC has said who is talking.

A flat 256 KiB per unauthenticated connection let 1,000 dialers that each held a partial Hello
take a coordinator to 303 MB. The ceiling is instead computed from the limits of each field of
the FT/2 ``Hello{host, world_size, model_sigs, ranks, nonce}`` as CBOR encodes it (a definite-
length head of 1, 2, 3, 5 or 9 bytes, then the content):

- ``host``: 1-255 bytes of UTF-8;
- ``world_size``: a u32;
- ``model_sigs``: at most ``MAX_MODEL_SIGS`` entries, each a name of at most
  ``MAX_MODEL_SIG_NAME`` UTF-8 bytes and a digest of at most ``MAX_MODEL_SIG_DIGEST`` bytes
  (SHA-512 fits; flodl's signatures are 32 bytes);
- ``ranks``: at most ``world_size`` distinct u32s, each below ``world_size``;
- ``nonce``: 16 bytes;
- and, for a ``Resume`` (which is a Hello plus a field), ``generation``: a u64.

A floor of ``MIN_HELLO_CEILING`` keeps a relay whose world size (and so rank list) is somewhat
larger than the coordinator's decodable, so that it fails as an authenticated contradiction that
names both numbers rather than as an anonymous oversized record.
"""

from __future__ import annotations

from ._constants import NONCE_LEN

MAX_HOST_BYTES = 255
MAX_MODEL_SIGS = 64
MAX_MODEL_SIG_NAME = 128
MAX_MODEL_SIG_DIGEST = 64
MIN_HELLO_CEILING = 16 * 1024
_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1


def cbor_head_len(value: int) -> int:
    """Bytes of a CBOR head carrying ``value`` (an unsigned int, or a length)."""
    if value < 24:
        return 1
    if value < 1 << 8:
        return 2
    if value < 1 << 16:
        return 3
    if value < 1 << 32:
        return 5
    return 9


def max_hello_payload(world_size: int) -> int:
    """The largest CBOR payload of a legal Hello or Resume in a world of ``world_size`` ranks
    (bytes), or ``MIN_HELLO_CEILING`` when that is larger."""
    if world_size < 1:
        raise ValueError(f"max_hello_payload: expected world_size >= 1, got {world_size}")
    fields = 7  # [variant index, host, world_size, model_sigs, ranks, nonce(, generation)]
    sig_entry = (cbor_head_len(MAX_MODEL_SIG_NAME) + MAX_MODEL_SIG_NAME
                 + cbor_head_len(MAX_MODEL_SIG_DIGEST) + MAX_MODEL_SIG_DIGEST)
    size = (
        cbor_head_len(fields)
        + cbor_head_len(1)  # the variant index of Hello
        + cbor_head_len(MAX_HOST_BYTES) + MAX_HOST_BYTES
        + cbor_head_len(_U32_MAX)
        + cbor_head_len(MAX_MODEL_SIGS) + MAX_MODEL_SIGS * sig_entry
        + cbor_head_len(world_size) + world_size * cbor_head_len(world_size - 1)
        + cbor_head_len(NONCE_LEN) + NONCE_LEN
        + cbor_head_len(_U64_MAX)  # a Resume's generation
    )
    return max(size, MIN_HELLO_CEILING)
