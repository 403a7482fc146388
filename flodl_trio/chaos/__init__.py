"""Fault injection: a real loopback TCP proxy and a stream wrapper that cut, stall, corrupt,
delay, drip or reset the bytes passing through them.

A :class:`FaultPlan` says what goes wrong on one connection. :func:`open_chaos_proxy` applies
plans to real TCP connections (the point is what the OS does: FIN, RST, a full window);
:class:`FaultyStream` applies the same plan to any :class:`trio.abc.Stream`, typically a
:class:`~flodl_trio.testing.MemoryStream` under ``MockClock``.

Directions: ``"up"`` is client→server (dialer→target), ``"down"`` is server→client, ``"both"``
applies the fault to each direction independently. Byte offsets count from the first byte of that
direction; an offset fault triggers once exactly that many bytes have been forwarded.
:func:`upstream_handshake_bytes` and :func:`rank_handshake_bytes` say where each step of a
handshake lies; :class:`FaultyDialer` puts the first connections of a dialer through plans.
"""


from ._dials import FaultyDialer
from ._faulty_stream import FaultyStream
from ._handshakes import HandshakeBytes, rank_handshake_bytes, upstream_handshake_bytes
from ._plan import Direction, Fault, FaultPlan
from ._proxy import ChaosProxy, ProxiedConnection, open_chaos_proxy

__all__ = [
    "ChaosProxy",
    "Direction",
    "Fault",
    "FaultPlan",
    "FaultyDialer",
    "FaultyStream",
    "HandshakeBytes",
    "ProxiedConnection",
    "open_chaos_proxy",
    "rank_handshake_bytes",
    "upstream_handshake_bytes",
]
