""":class:`EtcdStore`: the session store in etcd v3, for a standby coordinator on another
machine (SPEC §4.7).

Keys under ``PREFIX``: ``PREFIX/leader`` (the leader's owner and generation, attached to its
lease), ``PREFIX/generation`` (the counter, decimal), ``PREFIX/state`` (the encoded
:class:`SessionState`) and ``PREFIX/address`` (JSON ``[[host, port], ...]``, attached to the
leader's lease, so it vanishes with the leader).

Election: a leader key created with ``create_revision == 0`` in a txn that also bumps the
generation (compared on its ``mod_revision``); a standby polls every ``ttl / 4`` until the key is
gone. The leader renews its lease every ``ttl / 3`` and steps down (``LeadershipLost``) when no
renewal succeeded for the lease's TTL counted from the moment the last good renewal was *sent*:
etcd counts the same TTL from when it *received* it, so the leader always steps down before a
standby can win. Writes are txns comparing ``PREFIX/generation`` with the writer's, that the
writer's lease still holds the leader key, and the key's revision with the writer's last write.
Requests fail over between the endpoints (``_etcd_http``); TLS and the etcd user are
``_etcd_config``'s.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from typing import Any

import trio

from .._errors import ConfigError, LeadershipLost, StoreAuthError, StoreCorrupt, StoreUnavailable
from ._base import SessionStore, StoreUsage
from ._etcd_config import lease_ttl, make_access, parse_endpoints, step_down_margin
from ._etcd_http import EtcdCallError, EtcdHttp, b64, endpoint_text, unb64
from ._state import SessionState

log = logging.getLogger("flodl_trio.store")

NOT_FOUND = 5  # gRPC status code etcd answers for a lease that is gone
PUT_ROUNDS = 8  # a fenced put sent again on the revision found: bounded (see _fenced_put)
OUT_OF_RANGE = 11  # ... for a revision compacted already
COMPACT_EVERY = 300.0  # seconds of history kept, and between two compactions (kube-apiserver's)


class EtcdStore(SessionStore):
    """The session store in etcd v3, through its JSON gateway (``/v3/...``, etcd >= 3.4).

    Args:
        endpoints: the etcd cluster's client URLs: ``"HOST:PORT"``, ``"http://HOST:PORT"`` or
            ``"https://HOST:PORT"`` strings (all TLS or none), or ``(host, port)`` pairs.
            Requests go to the endpoint that answered last and fail over to the next.
        prefix: the key prefix of this session (``"flodl/run1"``); one prefix per run.
        ttl: the leader's lease TTL in seconds: how long a standby waits after the leader
            vanished, and how long a leader cut off from etcd keeps leading. etcd grants at least
            its minimum (1.5 election timeouts, 2 s with its defaults); the granted TTL counts.
            With several endpoints it must ride out an etcd leader election (:attr:`min_ttl`;
            a shorter one is a ``ConfigError``); None: 2 s, or :attr:`min_ttl` if longer.
        connect_timeout: the bound of each call (every endpoint tried), and so of the
            ``StoreUnavailable`` error for an unreachable or unhealthy etcd at start.
        request_timeout: the bound of one attempt on one endpoint before the next is tried (a
            frozen member accepts connections but never answers).
        election_timeout: the etcd cluster's ``--election-timeout`` in seconds (etcd's
            default 1 s), which :attr:`min_ttl` is computed from.
        ca_file: the CA bundle that signed the etcd members' certificates (TLS endpoints;
            None: the system's CAs).
        cert_file: the client certificate, for an etcd that runs with ``--client-cert-auth``
            (PEM; it holds the key too unless ``key_file`` is given).
        key_file: the client certificate's private key.
        user: the etcd user (RBAC) to authenticate as; its role needs readwrite on the prefix.
        password_file: a file holding that user's password (one line).
        password: the password itself (for a caller that holds it already).

    Raises:
        ConfigError: an endpoint, prefix or option that cannot work; a TLS or password file
            that cannot be read (they are read now, nothing is sent to etcd yet).
    """

    def __init__(self, endpoints: str | Sequence[str | tuple[str, int]], prefix: str, *,
                 ttl: float | None = None, connect_timeout: float = 5.0,
                 request_timeout: float = 0.5, election_timeout: float = 1.0,
                 ca_file: str | None = None, cert_file: str | None = None,
                 key_file: str | None = None, user: str | None = None,
                 password_file: str | None = None, password: str | None = None) -> None:
        parsed, tls = parse_endpoints(endpoints)
        clean = prefix.strip("/")
        if not clean:
            raise ConfigError(f"etcd store: expected a non-empty key prefix, got {prefix!r}")
        self.ttl, self.min_ttl = lease_ttl(ttl, endpoints=len(parsed),
                                           connect_timeout=connect_timeout,
                                           request_timeout=request_timeout,
                                           election_timeout=election_timeout)
        access = make_access(tls=tls, ca_file=ca_file, cert_file=cert_file, key_file=key_file,
                             user=user, password=password, password_file=password_file)
        self._http = EtcdHttp(parsed, timeout=connect_timeout, attempt_timeout=request_timeout,
                              access=access, key_prefix=f"{clean}/")
        scheme = "etcds" if tls else "etcd"
        self.description = f"{scheme}://{','.join(endpoint_text(e) for e in parsed)}/{clean}"
        self.prefix = clean
        self._keys = {name: f"{clean}/{name}" for name in ("leader", "generation", "state",
                                                          "address")}
        self._revisions: dict[str, int] = {}  # key name -> its mod_revision after our last write
        self._lease: int | None = None
        self._lease_ttl = 0.0
        self._lease_deadline = 0.0  # when this leader must have stepped down, Trio clock
        self._generation: int | None = None
        self._checked = False
        self.granted_ttl: float | None = None  # what etcd granted (>= ttl), once acquired

    @property
    def generation(self) -> int | None:
        """This handle's generation while it leads, else None."""
        return self._generation

    # -- SessionStore -------------------------------------------------------------------------

    async def acquire(self, *, owner: str) -> int:
        await self._check_health()
        poll = max(0.05, self.ttl / 4)
        while True:
            try:
                won = await self._try_acquire(owner)
            except StoreAuthError:
                raise  # a certificate or a user etcd refuses: waiting cannot change it
            except StoreUnavailable:  # a standby rides out an etcd restart
                if self._lease is not None:
                    await self._revoke()
                await trio.sleep(poll)
                continue
            if won is not None:
                return won
            await trio.sleep(poll)

    async def current_leader(self) -> str | None:
        await self._check_health()
        leader = await self._get("leader")
        if leader is None:
            return None
        raw = unb64(leader.get("value"))
        try:
            return str(json.loads(raw)["owner"])
        except (ValueError, KeyError, TypeError):
            raise StoreCorrupt(f"leader record at {self._where('leader')}: expected JSON with "
                               f"an owner, got {raw[:80]!r}") from None

    async def keep_leadership(self, *, task_status: trio.TaskStatus[None]
                              = trio.TASK_STATUS_IGNORED) -> None:
        if self._lease is None or self._generation is None:
            raise LeadershipLost(f"store {self.description}: keep_leadership before acquire "
                                 f"(this handle does not lead)")
        task_status.started()
        deadline = self._lease_deadline
        problem = ""
        while True:
            sent = trio.current_time()
            granted = 0.0
            with trio.move_on_at(deadline) as scope:
                try:
                    granted = await self._renew()
                except StoreUnavailable as exc:
                    problem = str(exc)
            if scope.cancelled_caught and sent < deadline:
                problem = (self._http.failures_since(sent) or
                           f"etcd {self._http.current}: no answer to a renewal before then")
            elif scope.cancelled_caught and not problem:
                problem = "its deadline passed before a renewal"
            if granted > 0:
                deadline = self._lease_deadline = sent + self._margin(granted)
                wake = sent + granted / 3
            elif trio.current_time() >= deadline:
                generation = self._generation_text()
                self._lose()
                raise LeadershipLost(
                    f"store {self.description}: expected to renew the lease of generation "
                    f"{generation} within its {self._lease_ttl:g} s TTL, but no renewal "
                    f"succeeded ({problem}); stepping down")
            else:
                wake = trio.current_time() + min(0.1, self._lease_ttl / 10)
            await trio.sleep_until(min(wake, deadline))

    def lost_leadership(self) -> LeadershipLost | None:
        late = trio.current_time() - self._lease_deadline
        if self._generation is None or late < 0:
            return None
        lost = LeadershipLost(f"store {self.description}: expected to lead as generation "
                              f"{self._generation}, but its lease's deadline passed {late:.1f} s "
                              "ago without a renewal (this process did not run: paused or "
                              "starved); stepping down")
        self._lose()
        return lost

    async def load(self) -> SessionState | None:
        await self._check_health()
        kv = await self._get("state")
        if kv is None:
            return None
        return SessionState.decode(unb64(kv.get("value")), source=self._where("state"))

    async def save(self, state: SessionState) -> None:
        await self._fenced_put("state", state.encode(), state.generation, "save")
        await self._compact_history()

    async def publish_address(self, addresses: Sequence[tuple[str, int]]) -> None:
        if self._generation is None:
            raise LeadershipLost(f"store {self.description}: publish_address refused: this "
                                 f"handle does not lead (no acquire, or it stepped down)")
        value = json.dumps([[str(h), int(p)] for h, p in addresses]).encode()
        await self._fenced_put("address", value, self._generation, "publish_address",
                               with_lease=True)

    async def resolve_address(self) -> tuple[tuple[str, int], ...]:
        kv = await self._get("address")
        if kv is None:
            return ()
        raw = unb64(kv.get("value"))
        try:
            doc = json.loads(raw)
            out = tuple((str(h), int(p)) for h, p in doc)
        except (ValueError, TypeError):
            raise StoreCorrupt(f"leader address at {self._where('address')}: expected JSON "
                               f"[[host, port], ...], got {raw[:80]!r}") from None
        return out

    async def release(self) -> None:
        self._generation = None
        if self._lease is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(self._http.timeout):
                await self._revoke()
        self._lease = None

    async def aclose(self) -> None:
        await self.release()
        with trio.CancelScope(shield=True):
            await self._http.aclose()

    # -- internals ----------------------------------------------------------------------------

    def _where(self, name: str) -> str:
        return f"etcd {self._http.current} key {self._keys[name]!r}"

    def _generation_text(self) -> str:
        return str(self._generation) if self._generation is not None else "(none)"

    def _margin(self, granted: float) -> float:
        """How long after sending a renewal this leader may still lead: the TTL less a small
        margin for the time it takes to stop acting (closing connections)."""
        return granted - step_down_margin(granted)

    def _lose(self) -> None:
        # The lease is gone, or not ours to keep: revoking it on release would only wait on
        # an etcd that may not answer (a deposed leader must leave at once).
        self._generation = None
        self._lease = None

    async def _check_health(self) -> None:
        if not self._checked:
            try:
                await self._http.health()
            except StoreAuthError:
                raise  # it names the endpoint and what to fix: kept short enough for one line
            except StoreUnavailable as exc:
                raise StoreUnavailable(f"store {self.description}: {exc}") from None
            self._checked = True

    async def _get(self, name: str) -> dict[str, Any] | None:
        doc = await self._http.call("/v3/kv/range", {"key": b64(self._keys[name])})
        kvs = doc.get("kvs") or []
        return kvs[0] if kvs else None

    def _gen_value(self, kv: dict[str, Any] | None) -> int:
        if kv is None:
            return 0
        raw = unb64(kv.get("value"))
        if not raw.isdigit():
            raise StoreCorrupt(f"generation at {self._where('generation')}: expected a decimal "
                               f"counter, got {raw[:40]!r}")
        return int(raw)

    async def _try_acquire(self, owner: str) -> int | None:
        """One election round: the new generation if this handle won, None if another leads."""
        leader = await self._get("leader")
        if leader is not None:
            if self._lease is not None and int(leader.get("lease", 0)) == self._lease:
                return self._won(leader)  # our txn went through but its answer was lost
            if self._lease is not None:  # no lease kept alive while a standby waits
                await self._revoke()
            return None
        if self._lease is None:
            sent = trio.current_time()
            grant = await self._http.call("/v3/lease/grant", {"TTL": max(1, math.ceil(self.ttl))})
            self._lease = int(grant["ID"])
            self._lease_ttl = float(grant.get("TTL", 0))
            self.granted_ttl = self._lease_ttl
            self._lease_deadline = sent + self._margin(self._lease_ttl)
        gen_kv = await self._get("generation")
        new = self._gen_value(gen_kv) + 1
        value = json.dumps({"owner": owner, "generation": new}).encode()
        leader_key, gen_key = b64(self._keys["leader"]), b64(self._keys["generation"])
        answer = await self._http.call("/v3/kv/txn", {
            "compare": [
                {"key": leader_key, "target": "CREATE", "result": "EQUAL",
                 "create_revision": "0"},
                {"key": gen_key, "target": "MOD", "result": "EQUAL",
                 "mod_revision": str(gen_kv.get("mod_revision", 0) if gen_kv else 0)},
            ],
            "success": [
                {"request_put": {"key": leader_key, "value": b64(value),
                                 "lease": str(self._lease)}},
                {"request_put": {"key": gen_key, "value": b64(str(new))}},
            ],
        })
        if not answer.get("succeeded"):
            return None
        self._generation = new
        return new

    def _won(self, leader: dict[str, Any]) -> int:
        try:
            gen = int(json.loads(unb64(leader.get("value")))["generation"])
        except (ValueError, KeyError, TypeError):
            raise StoreCorrupt(f"leader record at {self._where('leader')}: expected JSON "
                               f"with a generation, got {unb64(leader.get('value'))[:80]!r}"
                               ) from None
        self._generation = gen
        return gen

    async def _revoke(self) -> None:
        lease, self._lease = self._lease, None
        try:
            await self._http.call("/v3/lease/revoke", {"ID": str(lease)})
        except StoreUnavailable:
            pass  # unreachable, or the lease is already gone: it expires on its own

    async def _renew(self) -> float:
        """One renewal: the TTL granted, after checking that the leader key is still ours."""
        lease = self._lease
        if lease is None:
            raise LeadershipLost(f"store {self.description}: the lease was released")
        try:
            answer = await self._http.call("/v3/lease/keepalive", {"ID": str(lease)})
        except EtcdCallError as exc:
            if exc.code != NOT_FOUND:
                raise
            answer = {}
        granted = float(answer.get("TTL", 0) or 0)
        if granted <= 0:
            generation = self._generation_text()
            self._lose()
            raise LeadershipLost(f"store {self.description}: expected to renew lease "
                                 f"{lease:x} of generation {generation}, but etcd "
                                 f"{self._http.current} says it expired; stepping down")
        leader = await self._get("leader")
        if leader is None or int(leader.get("lease", 0)) != lease:
            holder = "nobody" if leader is None else repr(unb64(leader.get("value"))[:80])
            generation = self._generation_text()
            self._lose()
            raise LeadershipLost(f"store {self.description}: expected {self._keys['leader']!r}"
                                 f" to be held by our lease {lease:x} (generation "
                                 f"{generation}), but it is held by {holder}; stepping down")
        return granted

    async def _fenced_put(self, name: str, value: bytes, generation: int, what: str, *,
                          with_lease: bool = False) -> None:
        """Write ``value`` at key ``name`` in a txn fenced on our generation and lease.

        A txn whose answer was lost (the member froze, the call failed over) may have been
        applied, or may still be, later: the transport then sends it to another endpoint.
        Sending the same put again is harmless (the same value under the same fence), but a copy
        that a frozen member applies *after* a newer save would bring an old state back. So the
        txn also compares the key's ``mod_revision`` with the one our last write left: every
        older copy then fails. A mismatch while the generation and lease are still ours can only
        come from such a copy of ours; the put is sent again on the revision found.
        """
        lease = self._lease
        if lease is None or self._generation is None:
            raise LeadershipLost(f"store {self.description}: {what} as generation {generation} "
                                 f"refused: this handle does not lead (no acquire, or it "
                                 f"stepped down)")
        leader_key, gen_key = b64(self._keys["leader"]), b64(self._keys["generation"])
        key = b64(self._keys[name])
        put: dict[str, Any] = {"key": key, "value": b64(value)}
        if with_lease:
            put["lease"] = str(lease)
        for _ in range(PUT_ROUNDS):
            answer = await self._http.call("/v3/kv/txn", {
                "compare": [
                    {"key": gen_key, "target": "VALUE", "result": "EQUAL",
                     "value": b64(str(generation))},
                    {"key": leader_key, "target": "LEASE", "result": "EQUAL",
                     "lease": str(lease)},
                    {"key": key, "target": "MOD", "result": "EQUAL",
                     "mod_revision": str(self._revisions.get(name, 0))},
                ],
                "success": [{"request_put": put}],
                "failure": [{"request_range": {"key": gen_key}},
                            {"request_range": {"key": leader_key}},
                            {"request_range": {"key": key, "keys_only": True}}],
            })
            if answer.get("succeeded"):
                self._revisions[name] = int((answer.get("header") or {}).get("revision", 0))
                return
            gen_kv, leader_kv, key_kv = [*_first_kvs(answer), None, None, None][:3]
            gen_now = _text(gen_kv)
            if gen_now == str(generation) and leader_kv is not None \
                    and int(leader_kv.get("lease", 0)) == lease:
                self._revisions[name] = int((key_kv or {}).get("mod_revision", 0))
                continue
            raise LeadershipLost(f"store {self.description}: {what} as generation {generation} "
                                 f"refused: the stored generation is {gen_now}, the leader key "
                                 f"holds {_text(leader_kv)} (not our lease {lease:x})")
        raise StoreUnavailable(f"store {self.description}: {what} as generation {generation}: "
                               f"expected {self._keys[name]!r} to stay at the revision found, "
                               f"but it moved {PUT_ROUNDS} times (concurrent writes of this "
                               f"handle)")

    # -- store growth (issue 34): usage and compaction ------------------------------------------
    # Every write is a new revision and etcd keeps every revision until something compacts the
    # history, so a long run fills etcd's quota (2 GiB by default) with old states. The leader
    # compacts, at most once per ``compact_every`` seconds, up to a revision of its own state
    # key that is at least that old; ``None`` leaves it to etcd's --auto-compaction-* flags.

    compact_every: float | None = COMPACT_EVERY
    _compact_mark: int | None = None  # our state key's revision when the history was last looked at
    _compact_due = -math.inf  # Trio clock: when the history may be looked at next
    compacted_to: int | None = None  # the revision this handle last compacted etcd's history to

    async def usage(self) -> StoreUsage:
        """The member's database size and the cluster's revision (``/v3/maintenance/status``);
        ``problems`` has the errors it reports, its alarms among them (``NOSPACE``: the quota
        is full and every write is refused until an operator compacts, defragments and
        disarms it)."""
        doc = await self._http.call("/v3/maintenance/status", {})
        size = _integer(doc.get("dbSize"))
        detail = {"db_size_in_use": _integer(doc.get("dbSizeInUse", size))}
        if self.compacted_to is not None:
            detail["compacted_to"] = self.compacted_to
        # etcd's own words, e.g. "memberID:8e9e05c52164694d alarm:NOSPACE" (writes refused)
        problems = tuple(f"etcd {self._http.current}: {str(e).strip()}"
                         for e in doc.get("errors") or ())
        return StoreUsage(kind="etcd", size_bytes=size,
                          revision=_integer((doc.get("header") or {}).get("revision")),
                          detail=detail, problems=problems)

    async def _compact_history(self) -> None:
        """After a save: compact the history up to our state key's revision of
        ``compact_every`` ago (physical=false: etcd does it in the background). Never fails the
        save that succeeded: a compaction that fails is tried again at the next due time."""
        every = self.compact_every
        if every is None or trio.current_time() < self._compact_due:
            return
        self._compact_due = trio.current_time() + every
        try:
            kv = await self._http.call("/v3/kv/range", {"key": b64(self._keys["state"]),
                                                        "keys_only": True})
            kvs = kv.get("kvs") or []
            now = _integer(kvs[0].get("mod_revision")) if kvs else None
            mark, self._compact_mark = self._compact_mark, now
            if mark is not None:
                await self._http.call("/v3/kv/compaction", {"revision": str(mark),
                                                            "physical": False})
                self.compacted_to = mark
        except EtcdCallError as exc:  # compacted past it already (auto-compaction): fine
            if exc.code != OUT_OF_RANGE:
                log.warning("store %s: compacting etcd's history failed: %s", self.description,
                            exc)
        except StoreUnavailable as exc:
            log.warning("store %s: compacting etcd's history failed: %s", self.description, exc)


def _first_kvs(answer: dict[str, Any]) -> list[dict[str, Any] | None]:
    """The first key of each range a txn's failure branch answered (None where none)."""
    out: list[dict[str, Any] | None] = []
    for response in answer.get("responses") or []:
        kvs = (response.get("response_range") or {}).get("kvs") or []
        out.append(kvs[0] if kvs else None)
    return out


def _text(kv: dict[str, Any] | None) -> str:
    return "none" if kv is None else unb64(kv.get("value")).decode(errors="replace")


def _integer(value: Any) -> int:
    """An int64 of etcd's JSON gateway (sent as a decimal string), 0 when absent."""
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0
