"""EtcdStore against a production-like etcd: client TLS with client certificates required
(``--client-cert-auth``, certificates made with trustme) and RBAC (a root user, a ``flodl`` user
whose role may only touch ``flodl/``), simple tokens that expire after 1 s idle. End to end
(acquire, save, load, a standby's takeover, a relay resolving the leader) through ``etcds://``
URLs, and one clear line, at once, for each thing etcd or the client refuses."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from flodl_trio import RelayConfig, StoreAuthError, StoreUnavailable
from flodl_trio.cli._targets import coordinator_target
from flodl_trio.relay import StoreDialer
from flodl_trio.store import EtcdStore, open_store

from helpers.cli_procs import Proc, one_line
from helpers.scripts import load_script
from helpers.store import keeping, standing_by, state

etcd_helper = load_script("_etcd")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(etcd_helper.etcd_binary() is None,
                                 reason="etcd is not installed (apt-get install etcd-server)")]
PASSWORD = "correct horse"


class Secured:
    """The TLS etcd, its certificates and the password file of user ``flodl``."""

    def __init__(self, server: Any, tls: Any, password_file: Path) -> None:
        self.server, self.tls, self.password_file = server, tls, password_file
        self.endpoint = server.endpoint

    def url(self, prefix: str, *, query: str | None = None) -> str:
        if query is None:
            query = f"{self.tls.query()}&user=flodl&password_file={self.password_file}"
        return f"etcds://{self.endpoint}/{prefix}?{query}"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    root = tmp_path_factory.mktemp("etcd-tls")
    tls = etcd_helper.EtcdTLS(root / "pki")
    password_file = root / "flodl.password"
    password_file.write_text(PASSWORD + "\n")  # as `echo` writes it
    with etcd_helper.EtcdServer(root, tls=tls, auth_token_ttl=1) as server:
        server.enable_auth()
        server.add_user("flodl", PASSWORD, prefix="flodl/")
        yield Secured(server, tls, password_file)


async def test_a_tls_and_auth_store_works_end_to_end_with_a_standby_and_a_relay(
        secured: Secured) -> None:
    url = secured.url("flodl/tls-e2e")
    leader = open_store(url, ttl=1, env={})
    assert leader.description == f"etcds://{secured.endpoint}/flodl/tls-e2e"  # no query, ever
    # the standby's options from the environment instead of the URL
    standby = open_store(f"etcds://{secured.endpoint}/flodl/tls-e2e", ttl=1, env={
        "FLODL_ETCD_CA": secured.tls.ca_file, "FLODL_ETCD_CERT": secured.tls.cert_file,
        "FLODL_ETCD_KEY": secured.tls.key_file, "FLODL_ETCD_USER": "flodl",
        "FLODL_ETCD_PASSWORD": PASSWORD})
    relay_side = coordinator_target(url, config=RelayConfig())
    assert isinstance(relay_side, StoreDialer)
    gen1 = await leader.acquire(owner="coordinator a")
    await leader.save(state(gen1, failures=1))
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    try:
        async with trio.open_nursery() as nursery:
            keeper = keeping(nursery, leader)
            won = standing_by(nursery, standby, "coordinator b")
            await leader.publish_address([("127.0.0.1", port)])
            await relay_side.check()
            stream = await relay_side()  # the relay resolves the leader through etcds://
            await stream.aclose()
            await trio.sleep(1.6)  # the relay's token expired (1 s idle): it authenticates again
            await (await relay_side()).aclose()
            await leader.save(state(gen1, failures=2))
            assert not won
            crashed = trio.current_time()
            keeper.cancel()
            await won.wait(5)
        print(f"etcd with TLS and auth: the standby took over {won.at - crashed:.2f} s after the "
              f"leader stopped renewing (TTL 1 s)")
        assert won.value == gen1 + 1
        assert await standby.load() == state(gen1, failures=2)
    finally:
        for listener in listeners:
            await listener.aclose()
        for store in (leader, standby):
            await store.aclose()
        await relay_side.aclose()


def refused(secured: Secured, **options: str) -> EtcdStore:
    return EtcdStore(f"https://{secured.endpoint}", "flodl/refused", ttl=1,
                     connect_timeout=2, **options)


@pytest.mark.parametrize("case", ["no certificate", "another CA's certificate",
                                  "server not trusted", "wrong password", "no user",
                                  "outside its role"])
async def test_what_etcd_or_the_client_refuses_is_one_clear_line_at_once(
        secured: Secured, tmp_path: Path, case: str) -> None:
    tls = secured.tls
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not it\n")
    user = {"user": "flodl", "password_file": str(secured.password_file)}
    client = {"ca_file": tls.ca_file, "cert_file": tls.cert_file, "key_file": tls.key_file}
    store, expected = {
        "no certificate": (refused(secured, ca_file=tls.ca_file, **user),
                           r"requires a TLS client certificate \(.*\): give cert_file/key_file"),
        "another CA's certificate": (
            refused(secured, ca_file=tls.ca_file, cert_file=tls.rogue_cert_file,
                    key_file=tls.rogue_key_file, **user),
            r"refused this client's TLS certificate \(.*\): is cert_file signed by a CA of "
            r"its --trusted-ca-file\?"),
        "server not trusted": (refused(secured, cert_file=tls.cert_file, key_file=tls.key_file,
                                       **user),
                               r"its TLS certificate did not verify \(.*\): give the CA that "
                               r"signed it: ca_file"),
        "wrong password": (refused(secured, **client, user="flodl", password_file=str(wrong)),
                           r"refused user 'flodl' \(invalid user ID or password\): check the "
                           r"user and password_file"),
        "no user": (refused(secured, **client),
                    r"requires authentication \(/v3/kv/range: permission denied\): give user "
                    r"and password_file"),
        "outside its role": (
            EtcdStore(f"https://{secured.endpoint}", "other/run", ttl=1, **client, **user),
            r"user 'flodl' may not /v3/kv/range under 'other/run/' \(permission denied\): grant "
            r"its role readwrite on that prefix"),
    }[case]
    started = trio.current_time()
    with pytest.raises(StoreAuthError, match=rf"^etcd {secured.endpoint}:? " + expected) as info:
        await store.current_leader()
    assert "\n" not in str(info.value) and len(str(info.value)) < 170, str(info.value)
    with trio.fail_after(2), pytest.raises(StoreAuthError):
        await store.acquire(owner="x")  # a standby does not wait through it
    assert trio.current_time() - started < 1.5
    await store.aclose()


async def test_plain_http_to_a_tls_etcd_says_to_use_etcds(secured: Secured) -> None:
    store = open_store(f"etcd://{secured.endpoint}/flodl/plain", ttl=1, env={})
    with pytest.raises(StoreUnavailable, match=re.escape(
            f"{secured.endpoint}: /health failed: connection closed before any answer (a TLS "
            f"etcd does that to plain HTTP: is it etcds://?)")):
        await store.current_leader()
    await store.aclose()


def test_a_coordinator_or_relay_etcd_refuses_exits_1_with_one_line_and_no_traceback(
        secured: Secured, env: dict[str, str], procs: list[Proc]) -> None:
    no_cert = secured.url("flodl/cli", query=f"ca={secured.tls.ca_file}&user=flodl&"
                          f"password_file={secured.password_file}")
    coordinator = Proc("coordinator", "--listen", "127.0.0.1:0", "--world-size", "1",
                       "--store", no_cert, env=env)
    relay_env = dict(env, FLODL_ETCD_USER="flodl", FLODL_ETCD_PASSWORD="not it")
    relay = Proc("relay", "--coordinator", secured.url("flodl/cli", query=secured.tls.query()),
                 "--host", "h", "--ranks", "0", "--world-size", "1", env=relay_env)
    procs += [coordinator, relay]
    assert coordinator.wait() == 1 and relay.wait() == 1
    assert one_line(coordinator) == (
        f"flodl-trio: StoreAuthError: etcd {secured.endpoint} requires a TLS client certificate "
        "(sslv3 alert bad certificate): give cert_file/key_file (?cert=&key=, "
        "$FLODL_ETCD_CERT/_KEY)")
    assert one_line(relay) == (
        f"flodl-trio: StoreAuthError: etcd {secured.endpoint} refused user 'flodl' (invalid "
        "user ID or password): check the user and password_file (?user=&password_file=, "
        "$FLODL_ETCD_USER/_PASSWORD_FILE)")
    assert not any("listening for ranks" in line for line in relay.out)  # ended before
