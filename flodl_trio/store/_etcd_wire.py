"""One HTTP/1.1 exchange with an etcd member over h11 (:func:`exchange`), and what its failures
mean: :class:`Failed` for one endpoint (try the next), :class:`~flodl_trio.StoreAuthError` for
a certificate, a user or a permission (no endpoint will answer otherwise: say what to fix)."""

from __future__ import annotations

import os
import ssl
from typing import Any

import attrs
import h11
import trio

from .._errors import StoreAuthError
from ._etcd_config import ENV, EtcdAccess

MAX_RESPONSE = 16 * 1024 * 1024  # a state is at most etcd's 1.5 MiB request limit, base64'd
TRANSIENT_CODES = (4, 14)  # gRPC DEADLINE_EXCEEDED, UNAVAILABLE: no leader, leader changed
PERMISSION_DENIED = 7
UNAUTHENTICATED = 16  # an expired or unknown auth token
# etcd 3.4 (3.4.23 here) refuses every gateway request made with a client certificate that has a
# Common Name: with --client-cert-auth the CN would be the etcd user, which the gateway cannot pass.
GATEWAY_CN = "CommonName of client sending a request against gateway"
PLAIN_TO_TLS = "HTTP request to an HTTPS server"

CA_HINT = f"ca_file (?ca=, ${ENV['ca']})"
CERT_HINT = f"cert_file/key_file (?cert=&key=, ${ENV['cert']}/_KEY)"
USER_HINT = f"user and password_file (?user=&password_file=, ${ENV['user']}/_PASSWORD_FILE)"

class Failed(Exception):
    """One attempt on one endpoint failed; ``transient``: it may pass (no leader, a stall),
    worth another pass over the endpoints; ``unsent``: the request never reached the server."""

    def __init__(self, message: str, *, transient: bool = False, unsent: bool = False) -> None:
        super().__init__(message)
        self.transient = transient
        self.unsent = unsent

    @classmethod
    def of(cls, exc: BaseException) -> Failed:
        return cls(cause_text(exc))


@attrs.define(eq=False)
class Conn:
    """A keep-alive connection to one endpoint."""

    endpoint: tuple[str, int]
    stream: trio.abc.Stream
    h11: h11.Connection = attrs.field(factory=lambda: h11.Connection(h11.CLIENT))
    used: bool = False

    def reusable(self) -> bool:
        """After a whole request and answer: ready for the next one (and marked used)."""
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            self.used = True
            return True
        return False


def cause_text(exc: BaseException) -> str:
    """The first OS error's text (trio's "all attempts to connect failed" hides it)."""
    seen = exc
    while True:
        if isinstance(seen, OSError) and seen.errno:
            return os.strerror(seen.errno).lower()
        inner = seen.__cause__
        if isinstance(inner, BaseExceptionGroup) and inner.exceptions:
            inner = inner.exceptions[0]
        if inner is None:
            return f"{type(exc).__name__}: {exc}"
        seen = inner


async def exchange(conn: Conn, method: str, path: str, body: bytes, headers: dict[str, str],
                   access: EtcdAccess) -> tuple[int, bytes]:
    """Send one request on ``conn`` and read its whole answer: (status, body).

    Raises:
        Failed: the connection broke (``unsent`` if a reused one closed before any answer).
        StoreAuthError: the TLS session broke on a certificate the server refused.
    """
    host = f"[{conn.endpoint[0]}]" if ":" in conn.endpoint[0] else conn.endpoint[0]
    fields = [("Host", f"{host}:{conn.endpoint[1]}"), ("Content-Length", str(len(body))),
              *headers.items()]
    if method == "POST":
        fields.append(("Content-Type", "application/json"))
    h = conn.h11
    try:
        out = h.send(h11.Request(method=method, target=path, headers=fields)) or b""
        if body:
            out += h.send(h11.Data(data=body)) or b""
        out += h.send(h11.EndOfMessage()) or b""
        await conn.stream.send_all(out)
        return await _read_answer(conn, tls=access.ssl_context is not None)
    except trio.BrokenResourceError as exc:
        if isinstance(exc.__cause__, ssl.SSLError):
            raise tls_problem(f"{host}:{conn.endpoint[1]}", exc, access) from None
        raise Failed.of(exc) from None
    except (OSError, h11.ProtocolError) as exc:
        raise Failed.of(exc) from None


async def _read_answer(conn: Conn, *, tls: bool) -> tuple[int, bytes]:
    h = conn.h11
    status = 0
    chunks: list[bytes] = []
    size = 0
    received = False
    while True:
        event = h.next_event()
        if event is h11.NEED_DATA:
            data = await conn.stream.receive_some(65536)
            if data:
                received = True
            elif not received:
                # a TLS etcd closes a plain-HTTP connection without a word
                raise Failed("connection closed before any answer" + (
                    "" if tls or conn.used else " (a TLS etcd does that to plain HTTP: is it "
                    "etcds://?)"), unsent=conn.used)
            h.receive_data(bytes(data))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            size += len(event.data)
            if size > MAX_RESPONSE:
                raise Failed(f"answer over {MAX_RESPONSE} bytes")
            chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return status, b"".join(chunks)
        elif isinstance(event, h11.ConnectionClosed):
            raise Failed("connection closed mid-answer")


def tls_problem(where: str, exc: BaseException, access: EtcdAccess) -> StoreAuthError | Failed:
    """What a TLS handshake or session that broke means, and what to do about it (one line a
    command can print whole)."""
    cause = exc.__cause__
    if isinstance(cause, ssl.SSLCertVerificationError):
        return StoreAuthError(f"etcd {where}: its TLS certificate did not verify "
                              f"({cause.verify_message}): give the CA that signed it: {CA_HINT}")
    if not isinstance(cause, ssl.SSLError):
        return Failed(f"TLS: {cause_text(exc)}")
    reason = (cause.reason or str(cause)).lower().replace("_", " ")
    if "wrong version number" in reason or "record layer" in reason:
        return StoreAuthError(f"etcd {where} does not answer TLS ({reason}): a plain-HTTP etcd "
                              f"is etcd://, not etcds://")
    if access.client_cert:
        return StoreAuthError(f"etcd {where} refused this client's TLS certificate ({reason}): "
                              f"is cert_file signed by a CA of its --trusted-ca-file?")
    return StoreAuthError(f"etcd {where} requires a TLS client certificate ({reason}): give "
                          f"{CERT_HINT}")


def answer_problem(where: str, path: str, status: int, answer: dict[str, Any] | bytes,
                   access: EtcdAccess, prefix: str) -> StoreAuthError | Failed | None:
    """What an error etcd answered means, or None for an error of the request itself."""
    if isinstance(answer, bytes):
        text = answer.decode(errors="replace").strip()
        if GATEWAY_CN in text:
            return StoreAuthError(f"etcd {where} refuses gateway requests made with a client "
                                  f"certificate that has a Common Name: issue it without a CN "
                                  f"(its names in the subject alternative names only)")
        if PLAIN_TO_TLS in text:
            return StoreAuthError(f"etcd {where} serves TLS, this client spoke plain HTTP: use "
                                  f"etcds:// (https:// endpoints)")
        return Failed(f"HTTP {status}: {text[:80]!r}", transient=True) if status >= 500 \
            else None
    code = int(answer.get("code", 0) or 0)
    message = str(answer.get("message") or answer.get("error") or f"HTTP {status}")
    message = message.removeprefix("etcdserver: ")
    if code in TRANSIENT_CODES:
        return Failed(message, transient=True)
    user = access.user
    if path == "/v3/auth/authenticate":
        if "not enabled" in message:
            return StoreAuthError(f"etcd {where} has authentication disabled, but user {user!r} "
                                  f"was given: give no user (or enable it in etcd)")
        return StoreAuthError(f"etcd {where} refused user {user!r} "
                              f"({message.removeprefix('authentication failed, ')}): check the "
                              f"{USER_HINT}")
    if code == PERMISSION_DENIED:
        if user is None:
            return StoreAuthError(f"etcd {where} requires authentication ({path}: {message}): "
                                  f"give {USER_HINT}")
        return StoreAuthError(f"etcd {where}: user {user!r} may not {path} under {prefix!r} "
                              f"({message}): grant its role readwrite on that prefix")
    if code == UNAUTHENTICATED:
        return StoreAuthError(f"etcd {where} refused the token of user {user!r} just after "
                              f"it authenticated ({message})")
    return None
