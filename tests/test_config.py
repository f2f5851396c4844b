"""memkv_vllm.core.config: precedence, parsing, validation, and that the auth key never leaks."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from memkv_vllm.core import config as cfgmod
from memkv_vllm.core.config import (
    CONFIG_KEYS,
    ConfigError,
    MemKVConfig,
    env_name,
    load_config,
    parse_server,
)

KEY_HEX = "0123456789abcdef" * 4
KEY_BYTES = bytes.fromhex(KEY_HEX)


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    # The loader warns once per unknown variable per process; tests need a clean slate.
    monkeypatch.setattr(cfgmod, "_warned_env", set())


def write_yaml(tmp_path: Path, data: Any, name: str = "memkv.yaml") -> str:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(p)


@contextlib.contextmanager
def raises_config(key: str | None, source_part: str) -> Iterator[None]:
    """Expect a ConfigError for `key` whose source (and message) mention `source_part`."""
    with pytest.raises(ConfigError) as info:
        yield
    err = info.value
    assert err.key == key, str(err)
    assert source_part in err.source, str(err)
    assert source_part in str(err)
    if key is not None:
        assert repr(key) in str(err)


# --- defaults and the settings table ------------------------------------------------------------


def test_defaults() -> None:
    c = load_config(env={})
    assert c == MemKVConfig()
    assert c.servers == ("127.0.0.1:7390",)
    assert c.auth_key is None
    assert c.transport == "tcp"
    assert c.rdma_devices == ()
    assert c.connections_per_server == 8
    assert c.connect_timeout_s == 1.0
    assert c.op_timeout_s == 10.0
    assert c.io_threads == 8
    assert c.lease_ms == 10_000
    assert c.sources == ()


def test_config_keys_and_env_names() -> None:
    assert CONFIG_KEYS == {
        "servers",
        "auth_key",
        "transport",
        "rdma_devices",
        "connections_per_server",
        "connect_timeout_s",
        "op_timeout_s",
        "io_threads",
        "lease_ms",
        "backend",
        "redis_username",
        "redis_password",
        "redis_mode",
        "redis_read_from_replicas",
        "redis_tls_ca",
        "redis_tls_cert",
        "redis_tls_key",
        "tls_ca",
        "tls_server_name",
        "tls_cert",
        "tls_key",
        "tls_allow_rdma",
    }
    assert env_name("servers") == "MEMKV_SERVERS"
    assert env_name("connect_timeout_s") == "MEMKV_CONNECT_TIMEOUT_S"


def test_docs_list_every_setting() -> None:
    # docs/config.md and the README table are the user's reference; keep them complete.
    root = Path(__file__).resolve().parent.parent
    for doc in ("docs/config.md", "README.md"):
        text = (root / doc).read_text()
        for key in CONFIG_KEYS:
            assert f"`{key}`" in text, f"{doc} does not document {key}"
            assert f"`{env_name(key)}`" in text, f"{doc} does not document {env_name(key)}"


@pytest.mark.parametrize("doc", ["docs/config.md", "README.md"])
def test_docs_state_the_real_defaults(doc: str) -> None:
    text = (Path(__file__).resolve().parent.parent / doc).read_text()
    rows = {
        line.split("|")[1].strip(): line
        for line in text.splitlines()
        if line.startswith("| `") and line.count("|") >= 4
    }
    defaults = MemKVConfig()  # `servers` has a factory: its default depends on the backend
    for a in attrs.fields(MemKVConfig):
        value = getattr(defaults, a.name)
        if a.name not in CONFIG_KEYS or value in (None, ()):
            continue
        shown = ",".join(value) if isinstance(value, tuple) else value
        assert f"`{shown}`" in rows[f"`{a.name}`"], f"{doc}: default of {a.name} is {shown}"


def test_immutable_and_slotted() -> None:
    c = MemKVConfig()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        c.io_threads = 3  # type: ignore[misc]
    assert not hasattr(c, "__dict__")
    assert hash(c) == hash(MemKVConfig())


# --- each environment variable ------------------------------------------------------------------


def test_env_all_settings() -> None:
    env = {
        "MEMKV_SERVERS": " 10.0.0.1:7000 , Node-2.Example.com:7001,[2001:DB8::1]:7002 ",
        "MEMKV_AUTH_KEY": KEY_HEX.upper(),
        "MEMKV_TRANSPORT": "AUTO",
        "MEMKV_RDMA_DEVICES": "mlx5_0, mlx5_1",
        "MEMKV_CONNECTIONS_PER_SERVER": "4",
        "MEMKV_CONNECT_TIMEOUT_S": "0.25",
        "MEMKV_OP_TIMEOUT_S": "30",
        "MEMKV_IO_THREADS": "16",
        "MEMKV_LEASE_MS": "0",
    }
    c = load_config(env=env)
    assert c.servers == ("10.0.0.1:7000", "node-2.example.com:7001", "[2001:db8::1]:7002")
    assert c.auth_key == KEY_BYTES
    assert c.transport == "auto"
    assert c.rdma_devices == ("mlx5_0", "mlx5_1")
    assert c.connections_per_server == 4
    assert c.connect_timeout_s == 0.25
    assert c.op_timeout_s == 30.0 and isinstance(c.op_timeout_s, float)
    assert c.io_threads == 16
    assert c.lease_ms == 0
    # the Redis backend's settings: tests/test_redis_config.py
    assert dict(c.sources) == {k: env_name(k) for k in CONFIG_KEYS if env_name(k) in env}


def test_empty_env_var_means_unset() -> None:
    c = load_config(env={"MEMKV_SERVERS": "", "MEMKV_AUTH_KEY": "  ", "MEMKV_CONFIG": ""})
    assert c == MemKVConfig()


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMKV_IO_THREADS", "3")
    monkeypatch.delenv("MEMKV_CONFIG", raising=False)
    assert load_config().io_threads == 3


# --- precedence: overrides > MEMKV_CONFIG yaml > MEMKV_* env > defaults -------------------------


def test_yaml_beats_env_and_env_fills_the_rest(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"io_threads": 5, "servers": ["h1:1", "h2:2"]})
    env = {"MEMKV_CONFIG": path, "MEMKV_IO_THREADS": "7", "MEMKV_LEASE_MS": "42"}
    c = load_config(env=env)
    assert c.io_threads == 5  # the file wins over the env var
    assert c.servers == ("h1:1", "h2:2")
    assert c.lease_ms == 42  # not in the file: the env var applies
    assert c.op_timeout_s == 10.0  # nowhere: default
    src = dict(c.sources)
    assert src["io_threads"] == f"MEMKV_CONFIG={path}"
    assert src["lease_ms"] == "MEMKV_LEASE_MS"
    assert "op_timeout_s" not in src


def test_overrides_beat_everything(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"io_threads": 5})
    env = {"MEMKV_CONFIG": path, "MEMKV_IO_THREADS": "7"}
    c = load_config({"io_threads": 9, "servers": "a:1,b:2"}, env=env)
    assert c.io_threads == 9
    assert c.servers == ("a:1", "b:2")
    assert dict(c.sources)["io_threads"] == "overrides"


def test_none_means_not_set_in_yaml_and_overrides(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "io_threads:\nlease_ms: null\n")
    env = {"MEMKV_CONFIG": path, "MEMKV_IO_THREADS": "7"}
    c = load_config({"lease_ms": None}, env=env)
    assert c.io_threads == 7
    assert c.lease_ms == 10_000


def test_yaml_string_values_parse_like_env(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        {"servers": "x:1, y:2", "io_threads": "12", "op_timeout_s": 3, "rdma_devices": "m0,m1"},
    )
    c = load_config(env={"MEMKV_CONFIG": path})
    assert c.servers == ("x:1", "y:2")
    assert c.io_threads == 12
    assert c.op_timeout_s == 3.0 and isinstance(c.op_timeout_s, float)
    assert c.rdma_devices == ("m0", "m1")


def test_empty_yaml_file_is_fine(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "# nothing here\n")
    assert load_config(env={"MEMKV_CONFIG": path}) == MemKVConfig()


def test_overrides_accept_bytes_key() -> None:
    assert load_config({"auth_key": KEY_BYTES}, env={}).auth_key == KEY_BYTES
    assert load_config({"auth_key": bytearray(KEY_BYTES)}, env={}).auth_key == KEY_BYTES


# --- unknown keys -------------------------------------------------------------------------------


def test_unknown_yaml_key_raises_naming_file(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"servers": "a:1", "io_thread": 4})
    with raises_config("io_thread", path):
        load_config(env={"MEMKV_CONFIG": path})


def test_unknown_override_raises() -> None:
    with raises_config("lease", "overrides"):
        load_config({"lease": 5}, env={})


def test_unknown_env_var_only_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    env = {"MEMKV_SERVRES": "a:1", "MEMKV_LOG": "debug", "MEMKV_LISTEN": "0.0.0.0:1", "OTHER": "x"}
    with caplog.at_level(logging.WARNING, logger="memkv_vllm.core.config"):
        assert load_config(env=env) == MemKVConfig()
        load_config(env=env)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1, msgs
    assert "MEMKV_SERVRES" in msgs[0]


# --- the yaml file itself -----------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.yaml")
    with raises_config(None, path):
        load_config(env={"MEMKV_CONFIG": path})


def test_yaml_not_a_mapping(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "- a\n- b\n")
    with raises_config(None, path):
        load_config(env={"MEMKV_CONFIG": path})


def test_bad_yaml_reports_position_not_content(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, f'auth_key: "{KEY_HEX}\nservers: [a:1\n')
    with pytest.raises(ConfigError) as info:
        load_config(env={"MEMKV_CONFIG": path})
    assert path in str(info.value)
    assert "line" in str(info.value)
    assert KEY_HEX not in str(info.value)


# --- servers ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "canon"),
    [
        ("127.0.0.1:7390", "127.0.0.1:7390"),
        ("localhost:1", "localhost:1"),
        ("LocalHost:65535", "localhost:65535"),
        ("host.example.:80", "host.example:80"),
        ("[::1]:7390", "[::1]:7390"),
        ("[0:0:0:0:0:0:0:1]:07390", "[::1]:7390"),
        ("[FE80::1]:9", "[fe80::1]:9"),
        ("  a-b.c:12  ", "a-b.c:12"),
        ("memkv_server_1:7390", "memkv_server_1:7390"),
    ],
)
def test_parse_server_valid(text: str, canon: str) -> None:
    assert parse_server(text) == canon


@pytest.mark.parametrize(
    "text",
    [
        "",
        "host",
        "host:",
        ":80",
        "host:0",
        "host:65536",
        "host:-1",
        "host:+80",
        "host:8O",
        "host:123456",
        "::1:80",
        "::1",
        "[::1]",
        "[::1]80",
        "[::1:80",
        "[zz::1]:80",
        "[127.0.0.1]:80",
        "a b:80",
        "-host:80",
        "host-:80",
        "1.2.3:80",
        "256.1.1.1:80",
        "a..b:80",
        "http://h:80",
        "h:80/x",
    ],
)
def test_parse_server_invalid(text: str) -> None:
    with pytest.raises(ValueError):
        parse_server(text)
    with raises_config("servers", "MEMKV_SERVERS"):
        load_config(env={"MEMKV_SERVERS": f"ok:1,{text}" if text else ","})


def test_ipv6_without_brackets_gets_a_hint() -> None:
    with pytest.raises(ConfigError, match=r"\[addr\]:port"):
        load_config(env={"MEMKV_SERVERS": "::1:7390"})


def test_duplicate_servers_after_canonicalisation() -> None:
    with raises_config("servers", "MEMKV_SERVERS"):
        load_config(env={"MEMKV_SERVERS": "Host:1,host:1"})
    with raises_config("servers", "MEMKV_SERVERS"):
        load_config(env={"MEMKV_SERVERS": "[::1]:5,[0::1]:5"})


def test_server_list_from_yaml_must_hold_strings(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"servers": [7390]})
    with raises_config("servers", path):
        load_config(env={"MEMKV_CONFIG": path})
    path = write_yaml(tmp_path, {"servers": []}, "empty.yaml")
    with raises_config("servers", path):
        load_config(env={"MEMKV_CONFIG": path})
    path = write_yaml(tmp_path, {"servers": {"a": 1}}, "map.yaml")
    with raises_config("servers", path):
        load_config(env={"MEMKV_CONFIG": path})


def test_direct_construction_requires_canonical_servers() -> None:
    with raises_config("servers", "MemKVConfig"):
        MemKVConfig(servers=("LOCALHOST:1",))
    with raises_config("servers", "MemKVConfig"):
        MemKVConfig(servers=["a:1"])  # type: ignore[arg-type]
    with raises_config("servers", "MemKVConfig"):
        MemKVConfig(servers=())


# --- auth key -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        KEY_HEX[:-1],
        KEY_HEX + "0",
        KEY_HEX[:-1] + "g",
        "0x" + KEY_HEX[2:],
        KEY_HEX[:32],
        "secret-password",
    ],
)
def test_bad_auth_key_names_key_but_not_value(bad: str) -> None:
    with raises_config("auth_key", "MEMKV_AUTH_KEY"):
        load_config(env={"MEMKV_AUTH_KEY": bad})
    with pytest.raises(ConfigError) as info:
        load_config(env={"MEMKV_AUTH_KEY": bad})
    assert bad not in str(info.value)
    assert bad not in repr(info.value)


def test_unquoted_numeric_yaml_auth_key(tmp_path: Path) -> None:
    digits = "1234567890" * 6 + "1234"
    path = write_yaml(tmp_path, f"auth_key: {digits}\n")
    with raises_config("auth_key", path):
        load_config(env={"MEMKV_CONFIG": path})
    with pytest.raises(ConfigError, match="quoted") as info:
        load_config(env={"MEMKV_CONFIG": path})
    assert digits not in str(info.value)
    path = write_yaml(tmp_path, f'auth_key: "{digits}"\n', "quoted.yaml")
    assert load_config(env={"MEMKV_CONFIG": path}).auth_key == bytes.fromhex(digits)


def test_auth_key_never_rendered() -> None:
    c = load_config(env={"MEMKV_AUTH_KEY": KEY_HEX})
    assert c.auth_key == KEY_BYTES
    for text in (repr(c), str(c), c.describe()):
        assert KEY_HEX not in text.lower()
        assert repr(KEY_BYTES) not in text
    assert "<redacted>" in repr(c)
    assert "auth=on" in c.describe()
    assert "auth=off" in MemKVConfig().describe()


def test_direct_construction_bad_key_length() -> None:
    with raises_config("auth_key", "MemKVConfig"):
        MemKVConfig(auth_key=b"short")


# --- transport and devices ----------------------------------------------------------------------


@pytest.mark.parametrize("value", ["tcp", "rdma", "auto", "shm", " TCP ", "Rdma", "SHM"])
def test_transport_valid(value: str) -> None:
    assert load_config(env={"MEMKV_TRANSPORT": value}).transport == value.strip().lower()


@pytest.mark.parametrize("value", ["udp", "rdma,tcp", "ib"])
def test_transport_invalid(value: str) -> None:
    with raises_config("transport", "MEMKV_TRANSPORT"):
        load_config(env={"MEMKV_TRANSPORT": value})


def test_transport_wrong_type_in_overrides() -> None:
    with raises_config("transport", "overrides"):
        load_config({"transport": 1}, env={})


@pytest.mark.parametrize("value", ["mlx5 0", "mlx5_0,mlx5_0", "a/b", "x" * 65])
def test_rdma_devices_invalid(value: str) -> None:
    with raises_config("rdma_devices", "MEMKV_RDMA_DEVICES"):
        load_config(env={"MEMKV_RDMA_DEVICES": value})


def test_rdma_devices_list_in_overrides() -> None:
    c = load_config({"rdma_devices": ["mlx5_2", "rxe0"], "transport": "rdma"}, env={})
    assert c.rdma_devices == ("mlx5_2", "rxe0")
    assert "rdma_devices=mlx5_2,rxe0" in c.describe()
    assert "rdma_devices=all" in load_config({"transport": "auto"}, env={}).describe()


# --- integers and timeouts ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("connections_per_server", "0"),
        ("connections_per_server", "1025"),
        ("connections_per_server", "2.0"),
        ("connections_per_server", "two"),
        ("io_threads", "0"),
        ("io_threads", "-4"),
        ("io_threads", "0x10"),
        ("io_threads", "1e3"),
        ("lease_ms", "-1"),
        ("lease_ms", "3600001"),
        ("lease_ms", "10s"),
        ("connect_timeout_s", "0"),
        ("connect_timeout_s", "-1"),
        ("connect_timeout_s", "nan"),
        ("op_timeout_s", "inf"),
        ("op_timeout_s", "100000"),
        ("op_timeout_s", "10s"),
    ],
)
def test_bad_numbers_from_env(key: str, bad: str) -> None:
    with raises_config(key, env_name(key)):
        load_config(env={env_name(key): bad})


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("io_threads", True),
        ("io_threads", 2.5),
        ("io_threads", [4]),
        ("connections_per_server", False),
        ("lease_ms", 1.0),
        ("op_timeout_s", True),
        ("op_timeout_s", [1]),
        ("connect_timeout_s", float("nan")),
    ],
)
def test_bad_numbers_from_yaml_and_overrides(tmp_path: Path, key: str, bad: Any) -> None:
    with raises_config(key, "overrides"):
        load_config({key: bad}, env={})
    if not (isinstance(bad, float) and bad != bad):  # NaN does not survive safe_dump usefully
        path = write_yaml(tmp_path, {key: bad})
        with raises_config(key, path):
            load_config(env={"MEMKV_CONFIG": path})


def test_direct_construction_validates_numbers() -> None:
    with raises_config("io_threads", "MemKVConfig"):
        MemKVConfig(io_threads=0)
    with raises_config("op_timeout_s", "MemKVConfig"):
        MemKVConfig(op_timeout_s=-1.0)
    with raises_config("lease_ms", "MemKVConfig"):
        MemKVConfig(lease_ms=True)  # type: ignore[arg-type]


def test_config_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        load_config(env={"MEMKV_IO_THREADS": "0"})


# --- describe -----------------------------------------------------------------------------------


def test_describe_is_one_line_with_every_setting() -> None:
    c = load_config(
        {"servers": ["a:1", "[::1]:2"], "auth_key": KEY_HEX}, env={"MEMKV_IO_THREADS": "3"}
    )
    line = c.describe()
    assert "\n" not in line
    assert "servers=a:1,[::1]:2" in line
    assert "transport=tcp" in line
    assert "rdma_devices" not in line  # irrelevant for tcp
    assert "connections_per_server=8" in line
    assert "connect_timeout_s=1" in line
    assert "op_timeout_s=10" in line
    assert "io_threads=3" in line
    assert "lease_ms=10000" in line
    assert "io_threads=MEMKV_IO_THREADS" in line
    assert "auth_key=overrides" in line
    assert KEY_HEX not in line


# --- property tests -----------------------------------------------------------------------------

_label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)
_hostname = (
    st.lists(_label, min_size=1, max_size=4)
    .map(".".join)
    .filter(lambda h: not h.replace(".", "").isdigit())
)


def rfc5952(a: ipaddress.IPv6Address) -> str:
    """The canonical spelling of the client (placement.rs): hex groups without leading zeros, the
    leftmost longest run of two or more zero groups as `::`, and no dotted-quad tail. Python up to
    3.12 writes exactly this; 3.13 writes IPv4-mapped addresses as `::ffff:1.2.3.4`."""
    groups = [f"{(int(a) >> (112 - 16 * i)) & 0xFFFF:x}" for i in range(8)]
    best, start = (0, 0), None
    for i, g in enumerate([*groups, "end"]):
        if g == "0" and start is None:
            start = i
        elif g != "0" and start is not None:
            best = max(best, (i - start, -start))
            start = None
    run, at = best[0], -best[1]
    if run < 2:
        return ":".join(groups)
    return ":".join(groups[:at]) + "::" + ":".join(groups[at + run:])


_ipv4 = st.ip_addresses(v=4).map(str)
_ipv6 = st.ip_addresses(v=6).map(lambda a: f"[{rfc5952(a)}]")
_server = st.builds(
    lambda h, p: f"{h}:{p}", st.one_of(_hostname, _ipv4, _ipv6), st.integers(1, 65535)
)

valid_configs = st.builds(
    MemKVConfig,
    servers=st.lists(_server, min_size=1, max_size=5, unique=True).map(tuple),
    auth_key=st.one_of(st.none(), st.binary(min_size=32, max_size=32)),
    transport=st.sampled_from(["tcp", "rdma", "auto", "shm"]),
    rdma_devices=st.lists(st.from_regex(r"[a-z0-9_]{1,12}", fullmatch=True), unique=True).map(
        tuple
    ),
    connections_per_server=st.integers(1, 1024),
    connect_timeout_s=st.floats(1e-3, 86_400.0),
    op_timeout_s=st.floats(1e-3, 86_400.0),
    io_threads=st.integers(1, 1024),
    lease_ms=st.integers(0, 3_600_000),
)


def _to_env(c: MemKVConfig) -> dict[str, str]:
    env = {
        "MEMKV_SERVERS": ",".join(c.servers),
        "MEMKV_TRANSPORT": c.transport,
        "MEMKV_RDMA_DEVICES": ",".join(c.rdma_devices),
        "MEMKV_CONNECTIONS_PER_SERVER": str(c.connections_per_server),
        "MEMKV_CONNECT_TIMEOUT_S": repr(c.connect_timeout_s),
        "MEMKV_OP_TIMEOUT_S": repr(c.op_timeout_s),
        "MEMKV_IO_THREADS": str(c.io_threads),
        "MEMKV_LEASE_MS": str(c.lease_ms),
    }
    if c.auth_key is not None:
        env["MEMKV_AUTH_KEY"] = c.auth_key.hex()
    return env


@settings(deadline=None)
@given(valid_configs)
def test_roundtrip_through_env(c: MemKVConfig) -> None:
    assert load_config(env=_to_env(c)) == c


@settings(max_examples=50, deadline=None)
@given(valid_configs)
def test_roundtrip_through_yaml(tmp_path_factory: pytest.TempPathFactory, c: MemKVConfig) -> None:
    data: dict[str, Any] = {
        "servers": list(c.servers),
        "transport": c.transport,
        "rdma_devices": list(c.rdma_devices),
        "connections_per_server": c.connections_per_server,
        "connect_timeout_s": c.connect_timeout_s,
        "op_timeout_s": c.op_timeout_s,
        "io_threads": c.io_threads,
        "lease_ms": c.lease_ms,
    }
    if c.auth_key is not None:
        data["auth_key"] = c.auth_key.hex()
    path = write_yaml(tmp_path_factory.mktemp("y"), data)
    # Env vars that disagree must lose to the file.
    env = {"MEMKV_CONFIG": path, "MEMKV_IO_THREADS": "1", "MEMKV_SERVERS": "other:1"}
    assert load_config(env=env) == c


@settings(deadline=None)
@given(valid_configs)
def test_describe_never_shows_key(c: MemKVConfig) -> None:
    line = c.describe()
    if c.auth_key is not None:
        assert c.auth_key.hex() not in line.lower()
        assert "auth=on" in line
    for s in c.servers:
        assert s in line


@settings(deadline=None)
@given(st.sampled_from(sorted(CONFIG_KEYS)), st.text(max_size=80))
def test_arbitrary_env_text_gives_config_or_config_error(key: str, text: str) -> None:
    try:
        load_config(env={env_name(key): text})
    except ConfigError as e:
        assert e.key == key and e.source == env_name(key)


def _auth_error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(env={"MEMKV_AUTH_KEY": text})
    return str(info.value)


@settings(deadline=None)
@given(st.text(max_size=100))
def test_auth_key_error_depends_only_on_length(text: str) -> None:
    # The message is a function of the length alone (and of "not hex" at the right length), so
    # it cannot carry any part of the candidate secret.
    t = text.strip()
    try:
        c = load_config(env={"MEMKV_AUTH_KEY": text})
    except ConfigError as e:
        stand_in = "g" * 64 if len(t) == 64 else "x" * len(t)
        assert str(e) == _auth_error(stand_in)
    else:
        assert c.auth_key is None if not t else c.auth_key == bytes.fromhex(t)


@settings(deadline=None)
@given(_server)
def test_parse_server_is_idempotent_and_canonical(s: str) -> None:
    canon = parse_server(s)
    assert parse_server(canon) == canon
    host, _, port = canon.rpartition(":")
    assert 1 <= int(port) <= 65535
    if host.startswith("["):
        assert rfc5952(ipaddress.IPv6Address(host[1:-1])) == host[1:-1]


@settings(deadline=None)
@given(st.lists(_server, min_size=1, max_size=5, unique=True))
def test_server_order_is_kept(servers: list[str]) -> None:
    # Placement must not depend on order, but the list itself is reported as given.
    c = load_config(env={"MEMKV_SERVERS": ",".join(servers)})
    assert c.servers == tuple(parse_server(s) for s in servers)


# --- TLS (docs/tls.md) ----------------------------------------------------------------------------


def test_tls_from_the_environment_and_from_a_yaml_section(tmp_path: Path) -> None:
    c = load_config(env={"MEMKV_TLS_CA": "/ca.pem", "MEMKV_TLS_ALLOW_RDMA": "1"})
    assert (c.tls, c.tls_ca, c.tls_allow_rdma) == (True, "/ca.pem", True)
    assert "tls=on" in c.describe()
    f = tmp_path / "c.yaml"
    f.write_text("tls:\n  ca: /ca.pem\n  server_name: kv.internal\n  cert: /c.pem\n  key: /k.pem\n")
    c = load_config(env={"MEMKV_CONFIG": str(f), "MEMKV_TLS_CA": "/env-ca.pem"})
    assert (c.tls_ca, c.tls_server_name, c.tls_cert, c.tls_key) == (
        "/ca.pem", "kv.internal", "/c.pem", "/k.pem")
    assert "tls=mutual" in c.describe()
    assert dict(c.sources)["tls_ca"] == f"MEMKV_CONFIG={f}"
    # The overrides take the section too.
    assert load_config({"tls": {"ca": "/o.pem"}}, env={}).tls_ca == "/o.pem"
    assert load_config(env={}).describe().endswith("tls=off")


@pytest.mark.parametrize("settings,key,says", [
    ({"tls": {"cert": "/c.pem", "key": "/k.pem"}}, "tls_cert", "needs tls_ca"),
    ({"tls": {"ca": "/ca.pem", "cert": "/c.pem"}}, "tls_cert", "go together"),
    ({"tls_allow_rdma": True}, "tls_allow_rdma", "needs tls_ca"),
    ({"tls": {"ca": "/a"}, "tls_ca": "/b"}, "tls_ca", "both"),
    ({"tls": {"cafile": "/a"}}, "tls.cafile", "unknown TLS setting"),
    ({"tls": "/ca.pem"}, "tls", "must be a mapping"),
    ({"backend": "redis", "tls": {"ca": "/ca.pem"}}, "tls_ca", "redis_tls_ca"),
])
def test_tls_settings_that_do_not_fit_together_name_the_key(
        settings: dict[str, Any], key: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(settings, env={})
    assert e.value.key == key and says in str(e.value), str(e.value)


def test_the_servers_tls_variables_are_not_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    env = {"MEMKV_TLS_SERVER_CERT": "/s.pem", "MEMKV_TLS_SERVER_KEY": "/s.key",
           "MEMKV_TLS_CLIENT_CA": "/ca.pem"}
    with caplog.at_level("WARNING"):
        assert load_config(env=env) == MemKVConfig()
    assert "MEMKV_TLS" not in caplog.text
