"""open_store(url): the command-line forms of the session stores, and a clear error for any
other form."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl_trio import ConfigError
from flodl_trio.store import EtcdStore, MemoryStore, SqliteStore, open_store


def test_each_accepted_form_opens_its_store(tmp_path: Path) -> None:
    store = open_store(f"sqlite:{tmp_path}/run.db")
    assert isinstance(store, SqliteStore) and store.path == tmp_path / "run.db"
    assert store.description == f"sqlite:{tmp_path}/run.db"
    relative = open_store("sqlite:state/run.db")
    assert isinstance(relative, SqliteStore) and relative.path == Path("state/run.db")
    # two endpoints: at least the TTL that rides out an etcd election (5 s at etcd's defaults)
    etcd = open_store("etcd://127.0.0.1:2379,10.0.0.2:2379/flodl/run1", ttl=6)
    assert isinstance(etcd, EtcdStore)
    assert etcd.description == "etcd://127.0.0.1:2379,10.0.0.2:2379/flodl/run1"
    assert etcd.prefix == "flodl/run1" and etcd.ttl == 6
    assert open_store("etcd://[::1]:2379/p").description == "etcd://[::1]:2379/p"
    assert isinstance(open_store("memory:"), MemoryStore)
    assert open_store("memory:test").description == "memory:test"


@pytest.mark.parametrize("url", [
    "", "run.db", "sqlite:", "file:/tmp/x.db", "etcd:127.0.0.1:2379/p", "etcd://127.0.0.1:2379",
    "etcd://127.0.0.1:2379/", "etcd:///prefix", "redis://127.0.0.1:6379/0",
])
def test_any_other_form_is_a_config_error_quoting_it_and_the_accepted_forms(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        open_store(url)
    assert repr(url) in str(info.value)
    assert "sqlite:PATH" in str(info.value) and "etcd://HOST:PORT" in str(info.value)


@pytest.mark.parametrize("url", ["etcd://127.0.0.1/p", "etcd://127.0.0.1:0/p",
                                 "etcd://127.0.0.1:99999/p", "etcd://https://h:1/p"])
def test_a_bad_etcd_endpoint_is_a_config_error_naming_it(url: str) -> None:
    with pytest.raises(ConfigError, match="etcd endpoint") as info:
        open_store(url)
    assert repr(url) in str(info.value)
