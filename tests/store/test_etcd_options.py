"""EtcdStore's options, checked before anything is sent: the minimum TTL that rides out an etcd
leader election (refused below it, the default above it), TLS and user options from keyword
arguments, an ``etcd://``/``etcds://`` URL's query or ``$FLODL_ETCD_*``, and never a password
on a command line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import trustme

from flodl_trio import ConfigError
from flodl_trio.store import EtcdStore, open_store

THREE = ["127.0.0.1:2379", "127.0.0.1:2380", "127.0.0.1:2381"]


def test_a_ttl_that_cannot_ride_out_an_etcd_election_is_refused_naming_both_numbers() -> None:
    with pytest.raises(ConfigError, match=re.escape(
            "etcd store: expected a ttl of at least 3 s, got 2 s: a shorter lease cannot ride "
            "out an etcd leader election (election_timeout 0.5 s) plus a lost member "
            "(request_timeout 0.5 s) across 3 endpoints")):
        EtcdStore(THREE, "flodl/x", ttl=2, election_timeout=0.5)
    with pytest.raises(ConfigError, match="expected a ttl of at least 5 s, got 4 s"):
        EtcdStore(THREE, "flodl/x", ttl=4)  # etcd's default election timeout, 1 s
    assert EtcdStore(THREE, "flodl/x", ttl=3, election_timeout=0.5).ttl == 3
    # etcd grants whole seconds: 2.5 is asked as 3
    assert EtcdStore(THREE, "flodl/x", ttl=2.5, election_timeout=0.5).ttl == 2.5
    # more endpoints, more members that may be lost (a minority) on the way to one that answers
    assert EtcdStore([*THREE, "h:1", "h:2"], "x", election_timeout=0.5).min_ttl == 4


def test_without_a_ttl_the_store_takes_the_minimum_and_one_endpoint_is_not_held_to_it() -> None:
    default = EtcdStore(THREE, "flodl/x")
    assert (default.min_ttl, default.ttl) == (5, 5.0)
    assert EtcdStore(THREE, "flodl/x", election_timeout=0.25).ttl == 2.0  # never below 2 s
    single = EtcdStore("127.0.0.1:2379", "flodl/x", ttl=1)  # nothing to fail over to
    assert (single.min_ttl, single.ttl) == (1, 1)
    store = open_store(f"etcd://{','.join(THREE)}/p?election_timeout=0.5", env={})
    assert isinstance(store, EtcdStore) and store.ttl == 3.0
    with pytest.raises(ConfigError, match=re.escape(
            f"store 'etcd://{','.join(THREE)}/p': etcd store: expected a ttl of at least 3 s, "
            "got 2 s")):
        open_store(f"etcd://{','.join(THREE)}/p?ttl=2&election_timeout=0.5", env={})


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, str]:
    ca = trustme.CA()
    client = ca.issue_cert("flodl-client")
    paths = {"ca": tmp_path / "ca.pem", "cert": tmp_path / "c.pem", "key": tmp_path / "k.pem",
             "password": tmp_path / "pw"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    client.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    client.private_key_pem.write_to_path(str(paths["key"]))
    paths["password"].write_text("s3cret\n")
    return {name: str(path) for name, path in paths.items()}


def test_an_etcds_url_takes_tls_and_user_from_its_query_or_the_environment(
        pki: dict[str, str]) -> None:
    query = f"ca={pki['ca']}&cert={pki['cert']}&key={pki['key']}&user=flodl&" \
            f"password_file={pki['password']}"
    store = open_store(f"etcds://10.0.0.5:2379,10.0.0.6:2379/flodl/run1?{query}&ttl=7", env={})
    assert isinstance(store, EtcdStore) and store.ttl == 7
    assert store.description == "etcds://10.0.0.5:2379,10.0.0.6:2379/flodl/run1"
    env = {"FLODL_ETCD_CA": pki["ca"], "FLODL_ETCD_CERT": pki["cert"],
           "FLODL_ETCD_KEY": pki["key"], "FLODL_ETCD_USER": "flodl",
           "FLODL_ETCD_PASSWORD_FILE": pki["password"]}
    assert open_store("etcds://10.0.0.5:2379/flodl/run1", env=env).description == \
        "etcds://10.0.0.5:2379/flodl/run1"
    # the environment's files are read: a missing one says so (the query's would win)
    with pytest.raises(ConfigError, match="cannot read password_file '/nonexistent'"):
        open_store("etcds://10.0.0.5:2379/flodl/run1", env={**env,
                   "FLODL_ETCD_PASSWORD_FILE": "/nonexistent"})
    with pytest.raises(ConfigError, match="cannot load the client certificate cert_file "
                       "'/nonexistent'"):
        open_store(f"etcds://10.0.0.5:2379/p?cert=/nonexistent&key={pki['key']}", env={})


@pytest.mark.parametrize(("url", "why"), [
    ("etcds://h:1/p?password=s3cret", "a password in the URL shows in `ps`: use "
     "?password_file= or $FLODL_ETCD_PASSWORD_FILE or $FLODL_ETCD_PASSWORD"),
    ("etcds://flodl:s3cret@h:1/p", "a user or password in the URL shows in `ps`"),
    ("etcd://h:1/p?ca=/etc/ca.pem", "?ca= is for TLS, but etcd:// is plain HTTP: use etcds://"),
    ("etcds://h:1/p?tls=1", "unknown option 'tls' after '?'; expected ca, cert, key, user, "
     "password_file, ttl, election_timeout, request_timeout"),
    ("etcds://h:1/p?ttl=2&ttl=3", "option 'ttl' given twice"),
    ("etcds://h:1/p?ttl=soon", "?ttl= expected seconds > 0, got 'soon'"),
    ("etcds://h:1/p?user=flodl", "expected a user and its password together, got a user "
     "without a password"),
    ("etcds://h:1/p?key=/k.pem", "key_file given without cert_file"),
])
def test_store_url_options_that_cannot_work_are_refused_naming_why(url: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        open_store(url, env={})
    assert why in str(info.value)
    assert "s3cret" not in str(info.value)  # a refused URL is quoted without its secrets
    shown = url.partition("?")[0].replace("flodl:s3cret@", "***@")
    assert str(info.value).startswith(f"store {shown!r}: ")


def test_tls_settings_from_the_environment_on_a_plain_url_are_refused_naming_the_variable(
        pki: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=re.escape(
            "$FLODL_ETCD_CA is for TLS, but etcd:// is plain HTTP: use etcds:// for a TLS etcd "
            "(or unset FLODL_ETCD_CA)")):
        open_store("etcd://h:1/p", env={"FLODL_ETCD_CA": pki["ca"]})


def test_endpoint_schemes_and_tls_keywords_must_agree(pki: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="expected all https:// or none"):
        EtcdStore(["https://h:1", "http://h:2"], "p")
    with pytest.raises(ConfigError, match="ca_file given for plain-HTTP endpoints: write them "
                       "as https://HOST:PORT"):
        EtcdStore("h:1", "p", ca_file=pki["ca"])
    with pytest.raises(ConfigError, match="expected password or password_file, got both"):
        EtcdStore("h:1", "p", user="u", password="x", password_file=pki["password"])
    store = EtcdStore(["https://h:1", "https://[::1]:2"], "p", ca_file=pki["ca"],
                      cert_file=pki["cert"], key_file=pki["key"], user="u", password="x")
    assert store.description == "etcds://h:1,[::1]:2/p"
