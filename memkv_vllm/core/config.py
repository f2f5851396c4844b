"""Connection settings for the memkv client: one typed, validated, immutable object.

Sources, highest precedence first:

1. ``overrides`` passed to :func:`load_config` (e.g. keys of a vLLM ``kv_connector_extra_config``),
2. the yaml file named by ``MEMKV_CONFIG``,
3. ``MEMKV_<KEY>`` environment variables (``MEMKV_SERVERS``, ``MEMKV_AUTH_KEY``, ...),
4. defaults.

A key set in the yaml file therefore wins over the matching environment variable: the file is
the deliberate, reviewed configuration, the environment is the convenient fallback.

Every bad value raises :class:`ConfigError` naming the key and where it came from. The auth key
never appears in an error, ``repr`` or :meth:`MemKVConfig.describe`.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs
import yaml

from memkv_vllm import _native

__all__ = [
    "CONFIG_ENV",
    "CONFIG_KEYS",
    "DEFAULT_PORT",
    "ENV_PREFIX",
    "ConfigError",
    "MemKVConfig",
    "env_name",
    "load_config",
    "parse_redis_url",
    "parse_server",
]

log = logging.getLogger(__name__)

ENV_PREFIX = "MEMKV_"
CONFIG_ENV = "MEMKV_CONFIG"
DEFAULT_PORT = 7390

# `shm`: the same-host data path (docs/shm.md); `auto` also takes it for servers on this host.
Transport = Literal["tcp", "rdma", "auto", "shm"]
TRANSPORTS: tuple[str, ...] = ("tcp", "rdma", "auto", "shm")
# Which engine holds the blocks: memkv's own servers, or Redis / Valkey (docs/redis.md).
Backend = Literal["memkv", "redis"]
BACKENDS: tuple[str, ...] = ("memkv", "redis")
RedisMode = Literal["auto", "cluster", "standalone"]
REDIS_MODES: tuple[str, ...] = ("auto", "cluster", "standalone")
REDIS_DEFAULT_SERVER = "redis://127.0.0.1:6379"
_REDIS_SCHEMES = ("redis", "rediss")  # rediss = TLS

# MEMKV_* variables that are not client settings but are legitimately set next to them (the
# server's own flags, logging, test fixtures). They are neither parsed nor warned about.
NON_CLIENT_ENV: frozenset[str] = frozenset(
    {
        CONFIG_ENV,
        "MEMKV_LOG",
        "MEMKV_LISTEN",
        "MEMKV_MEMORY",
        "MEMKV_LANES",
        "MEMKV_METRICS",
        "MEMKV_BIN",
        # `memkv serve --rdma`; the provider is read by the native client as well.
        "MEMKV_RDMA",
        "MEMKV_RDMA_PROVIDER",
        # The libfabric the native code loads (client and server alike).
        "MEMKV_LIBFABRIC",
        # The same-host path's socket (`memkv serve --shm-socket`; read by the native client).
        "MEMKV_SHM_SOCKET",
    }
)

# Upper bounds are sanity limits that catch unit mistakes (ms given for s, bytes for count); the
# wire format carries lease_ms as u32 but a lease longer than an hour only pins memory.
_MAX_THREADS = 1024
_MAX_CONNECTIONS = 1024
_MAX_LEASE_MS = 3_600_000
_MAX_TIMEOUT_S = 86_400.0
_AUTH_KEY_HEX_LEN = 64


class ConfigError(ValueError):
    """A missing, unknown or invalid setting. ``key`` and ``source`` say which one and where."""

    def __init__(self, key: str | None, source: str, message: str) -> None:
        self.key = key
        self.source = source
        self.reason = message
        where = source if key is None else f"{key!r} from {source}"
        super().__init__(f"memkv config: {where}: {message}")


# --- value checks -------------------------------------------------------------------------------
# Each check takes an already-typed value and raises ValueError with a message that never echoes
# the auth key. The loader's parsers turn strings (env, yaml) into typed values first.

_DEVICE_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_INT_RE = re.compile(r"^[+-]?[0-9]+$")


def parse_server(text: str) -> str:
    """Validate one ``host:port`` (``[v6addr]:port`` for IPv6) and return its canonical spelling.

    Canonical means lower-case host names and compressed IPv6, so that every process that lists
    the same servers hashes keys to the same places whatever the spelling. The native client
    does this (it canonicalises its own list the same way, so a Rust embedder places keys
    exactly like this package); ValueError says what is wrong with a bad address.
    """
    if not isinstance(text, str):
        raise ValueError(f"a server must be a 'host:port' string, got {type(text).__name__}")
    return str(_native.canonical_server(text))


def parse_redis_url(text: str) -> str:
    """Validate one ``redis://host:port`` / ``rediss://host:port`` (TLS) and return its canonical
    spelling (host:port canonical as in :func:`parse_server`; port 6379 when omitted).
    Credentials in the URL are refused without echoing it: they belong in ``redis_username`` /
    ``redis_password``, which are never printed."""
    if not isinstance(text, str):
        raise ValueError(f"a server must be a 'redis://host:port' string, got "
                         f"{type(text).__name__}")
    if "@" in text:
        raise ValueError("a server URL must not carry credentials (set redis_username / "
                         "redis_password); the URL is not shown")
    scheme, sep, rest = text.strip().partition("://")
    if not sep or scheme.lower() not in _REDIS_SCHEMES:
        raise ValueError(f"server {text!r} must look like 'redis://host:port' or "
                         f"'rediss://host:port'")
    hostport = rest[:-1] if rest.endswith("/") else rest
    if "/" in hostport or "?" in hostport:
        raise ValueError(f"server {text!r}: only 'scheme://host:port' is supported (no database "
                         f"number or options: Redis Cluster has database 0 only)")
    if hostport.endswith("]") or ":" not in hostport:  # no port given
        hostport += ":6379"
    return f"{scheme.lower()}://{parse_server(hostport)}"


def _is_redis_url(s: str) -> bool:
    return isinstance(s, str) and "://" in s


def _check_servers(value: tuple[str, ...]) -> None:
    if not isinstance(value, tuple) or not value:
        raise ValueError("at least one 'host:port' server is required")
    seen: set[str] = set()
    for s in value:
        canon = parse_redis_url(s) if _is_redis_url(s) else parse_server(s)
        if canon != s:
            # Constructed directly with a non-canonical spelling: refuse rather than silently
            # hash differently from a process that loaded the same list through load_config.
            raise ValueError(f"server {s!r} is not in canonical form (use {canon!r})")
        if canon in seen:
            raise ValueError(f"server {canon!r} is listed twice")
        seen.add(canon)


def _check_servers_for(backend: str, value: tuple[str, ...]) -> None:
    """`servers` as the backend reads them: memkv takes host:port, redis takes URLs."""
    _check_servers(value)
    urls = [_is_redis_url(s) for s in value]
    if backend == "redis" and not all(urls):
        raise ValueError("with backend 'redis', every server is a 'redis://host:port' or "
                         "'rediss://host:port' URL")
    if backend == "redis" and len({s.partition("://")[0] for s in value}) > 1:
        raise ValueError("mixes redis:// and rediss:// servers (TLS is all or nothing)")
    if backend != "redis" and any(urls):
        raise ValueError("lists a redis:// URL; set backend: redis to use Redis / Valkey")


def _check_choice(choices: tuple[str, ...]) -> Callable[[str], None]:
    def check(value: str) -> None:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {value!r}")

    return check


def _check_bool(value: bool) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {type(value).__name__}")


def _check_opt_text(value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError("must be a non-empty string")


def _check_auth_key(value: bytes | None) -> None:
    if value is not None and (not isinstance(value, bytes) or len(value) != 32):
        raise ValueError("must be 32 bytes (64 hex characters); the value is not shown")


def _check_transport(value: str) -> None:
    if value not in TRANSPORTS:
        raise ValueError(f"must be one of {', '.join(TRANSPORTS)}, got {value!r}")


def _check_devices(value: tuple[str, ...]) -> None:
    if not isinstance(value, tuple):
        raise ValueError("must be a list of RDMA device names")
    for d in value:
        if not isinstance(d, str) or not _DEVICE_RE.match(d):
            raise ValueError(f"{d!r} is not a valid RDMA device name (e.g. 'mlx5_0')")
    if len(set(value)) != len(value):
        raise ValueError("lists a device twice")


def _int_check(lo: int, hi: int) -> Callable[[int], None]:
    def check(value: int) -> None:
        # bool is an int subclass; True as a thread count is a typo, not a setting.
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise ValueError(f"must be in {lo}..{hi}, got {value}")

    return check


def _timeout_check(value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or not 0 < value <= _MAX_TIMEOUT_S:
        raise ValueError(f"must be a positive number of seconds up to {_MAX_TIMEOUT_S:g}")


def _validator(check: Callable[[Any], None]) -> Callable[[Any, attrs.Attribute, Any], None]:
    def validate(_inst: Any, attr: attrs.Attribute, value: Any) -> None:
        try:
            check(value)
        except ValueError as e:
            raise ConfigError(attr.name, "MemKVConfig(...) argument", str(e)) from None

    return validate


def _redact(value: bytes | None) -> str:
    return "None" if value is None else "<redacted>"


def _redact_text(value: str | None) -> str:
    return "None" if value is None else "<redacted>"


def _default_servers(inst: Any) -> tuple[str, ...]:
    # attrs builds fields in order: `backend` is already set when this runs.
    return (REDIS_DEFAULT_SERVER,) if inst.backend == "redis" else (f"127.0.0.1:{DEFAULT_PORT}",)


def _servers_validator(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    try:
        _check_servers_for(inst.backend, value)
    except ValueError as e:
        raise ConfigError(attr.name, "MemKVConfig(...) argument", str(e)) from None


# --- the settings object ------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class MemKVConfig:
    """How a process reaches the memkv cluster. Build it with :func:`load_config`."""

    backend: Backend = attrs.field(default="memkv", validator=_validator(_check_choice(BACKENDS)))
    servers: tuple[str, ...] = attrs.field(
        default=attrs.Factory(_default_servers, takes_self=True), validator=_servers_validator
    )
    # 32-byte HMAC-SHA256 key shared with every server; None = no auth.
    auth_key: bytes | None = attrs.field(
        default=None, repr=_redact, validator=_validator(_check_auth_key)
    )
    # 'auto' = RDMA when a usable device exists, else TCP; resolved by the client at connect time.
    transport: Transport = attrs.field(default="tcp", validator=_validator(_check_transport))
    # Empty = all devices the RDMA stack reports.
    rdma_devices: tuple[str, ...] = attrs.field(default=(), validator=_validator(_check_devices))
    # 8: on an H200 host the store's loads and stores rose from about a third of the 8-connection
    # loopback TCP ceiling at 2 connections to about 70% at 8 (docs/benchmarks.md).
    connections_per_server: int = attrs.field(
        default=8, validator=_validator(_int_check(1, _MAX_CONNECTIONS))
    )
    connect_timeout_s: float = attrs.field(default=1.0, validator=_validator(_timeout_check))
    op_timeout_s: float = attrs.field(default=10.0, validator=_validator(_timeout_check))
    io_threads: int = attrs.field(default=8, validator=_validator(_int_check(1, _MAX_THREADS)))
    # Lease that an exists() hit takes on the server so the value survives until the load;
    # 0 = lookups take no lease.
    lease_ms: int = attrs.field(default=10_000, validator=_validator(_int_check(0, _MAX_LEASE_MS)))
    # Redis / Valkey backend only (docs/redis.md). TLS is on when the servers are rediss:// URLs;
    # the three paths are handed to the Redis client as they are.
    redis_username: str | None = attrs.field(default=None, validator=_validator(_check_opt_text))
    redis_password: str | None = attrs.field(
        default=None, repr=_redact_text, validator=_validator(_check_opt_text)
    )
    redis_mode: RedisMode = attrs.field(
        default="auto", validator=_validator(_check_choice(REDIS_MODES))
    )
    redis_read_from_replicas: bool = attrs.field(default=False, validator=_validator(_check_bool))
    redis_tls_ca: str | None = attrs.field(default=None, validator=_validator(_check_opt_text))
    redis_tls_cert: str | None = attrs.field(default=None, validator=_validator(_check_opt_text))
    redis_tls_key: str | None = attrs.field(default=None, validator=_validator(_check_opt_text))
    # Where each non-default setting came from, for describe(); not part of equality.
    sources: tuple[tuple[str, str], ...] = attrs.field(default=(), eq=False, repr=False, hash=False)

    def describe(self) -> str:
        """One line for a startup log. Says whether auth is on, never the key itself."""
        if self.backend == "redis":
            return self._describe_redis()
        parts = [
            f"servers={','.join(self.servers)}",
            f"transport={self.transport}",
        ]
        if self.transport in ("rdma", "auto"):
            parts.append(f"rdma_devices={','.join(self.rdma_devices) or 'all'}")
        parts += [
            f"connections_per_server={self.connections_per_server}",
            f"connect_timeout_s={self.connect_timeout_s:g}",
            f"op_timeout_s={self.op_timeout_s:g}",
            f"io_threads={self.io_threads}",
            f"lease_ms={self.lease_ms}",
            f"auth={'on' if self.auth_key is not None else 'off'}",
        ]
        return self._with_sources("memkv " + " ".join(parts))

    def _describe_redis(self) -> str:
        parts = [
            "backend=redis",
            f"servers={','.join(self.servers)}",
            f"redis_mode={self.redis_mode}",
            f"read_from_replicas={self.redis_read_from_replicas}",
            f"connections_per_server={self.connections_per_server}",
            f"connect_timeout_s={self.connect_timeout_s:g}",
            f"op_timeout_s={self.op_timeout_s:g}",
            f"io_threads={self.io_threads}",
            f"user={self.redis_username or '-'}",
            f"password={'set' if self.redis_password is not None else 'unset'}",
        ]
        return self._with_sources("memkv " + " ".join(parts))

    def _with_sources(self, line: str) -> str:
        if self.sources:
            line += " (set by: " + ", ".join(f"{k}={src}" for k, src in self.sources) + ")"
        return line


CONFIG_KEYS: frozenset[str] = frozenset(
    a.name for a in attrs.fields(MemKVConfig) if a.name != "sources"
)


def env_name(key: str) -> str:
    """The environment variable for a setting: ``servers`` -> ``MEMKV_SERVERS``."""
    return ENV_PREFIX + key.upper()


# --- parsing raw values (strings from env/yaml, or typed values from yaml/overrides) -------------


def _split_list(raw: Any) -> list[Any]:
    if isinstance(raw, str):
        return [p.strip() for p in raw.split(",") if p.strip()]
    if isinstance(raw, (list, tuple)):
        return list(raw)
    raise ValueError(f"must be a comma-separated string or a list, got {type(raw).__name__}")


def _parse_servers(raw: Any) -> tuple[str, ...]:
    items = _split_list(raw)
    servers = tuple(parse_redis_url(s) if _is_redis_url(s) else parse_server(s) for s in items)
    _check_servers(servers)
    return servers


def _parse_auth_key(raw: Any) -> bytes | None:
    if isinstance(raw, (bytes, bytearray)):
        key = bytes(raw)
    elif isinstance(raw, str):
        text = raw.strip()
        if len(text) != _AUTH_KEY_HEX_LEN:
            raise ValueError(
                f"must be exactly {_AUTH_KEY_HEX_LEN} hex characters (32 bytes), got "
                f"{len(text)} characters; the value is not shown"
            )
        if not all(c in "0123456789abcdefABCDEF" for c in text):
            raise ValueError("contains characters other than 0-9a-f; the value is not shown")
        key = bytes.fromhex(text)
    else:
        # yaml reads an unquoted all-digit key as an int and drops leading zeros.
        raise ValueError(
            f"must be a quoted string of {_AUTH_KEY_HEX_LEN} hex characters, got "
            f"{type(raw).__name__}; the value is not shown"
        )
    _check_auth_key(key)
    return key


def _parse_transport(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"must be one of {', '.join(TRANSPORTS)}, got {type(raw).__name__}")
    value = raw.strip().lower()
    _check_transport(value)
    return value


def _parse_devices(raw: Any) -> tuple[str, ...]:
    items = _split_list(raw)
    devices = tuple(d.strip() if isinstance(d, str) else d for d in items)
    _check_devices(devices)
    return devices


def _choice_parser(choices: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(raw: Any) -> str:
        if not isinstance(raw, str):
            raise ValueError(f"must be one of {', '.join(choices)}, got {type(raw).__name__}")
        value = raw.strip().lower()
        _check_choice(choices)(value)
        return value

    return parse


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse_bool(raw: Any) -> bool:
    if isinstance(raw, str):
        text = raw.strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ValueError(f"must be true or false, got {raw.strip()!r}")
    _check_bool(raw)
    return bool(raw)


def _parse_text(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"must be a string, got {type(raw).__name__}")
    _check_opt_text(raw)
    return raw


def _parse_secret(raw: Any) -> str:
    if not isinstance(raw, str) or not raw:
        # yaml reads an unquoted all-digit password as a number: quote it.
        raise ValueError(f"must be a non-empty quoted string, got {type(raw).__name__}; the "
                         f"value is not shown")
    return raw


def _int_parser(check: Callable[[int], None]) -> Callable[[Any], int]:
    def parse(raw: Any) -> int:
        if isinstance(raw, str):
            text = raw.strip()
            if not _INT_RE.match(text):
                raise ValueError(f"must be an integer, got {text!r}")
            value = int(text)
        else:
            value = raw
        check(value)
        return value

    return parse


def _parse_timeout(raw: Any) -> float:
    if isinstance(raw, str):
        try:
            value: Any = float(raw.strip())
        except ValueError:
            raise ValueError(f"must be a number of seconds, got {raw.strip()!r}") from None
    else:
        value = raw
    _timeout_check(value)
    return float(value)


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "servers": _parse_servers,
    "auth_key": _parse_auth_key,
    "transport": _parse_transport,
    "rdma_devices": _parse_devices,
    "connections_per_server": _int_parser(_int_check(1, _MAX_CONNECTIONS)),
    "connect_timeout_s": _parse_timeout,
    "op_timeout_s": _parse_timeout,
    "io_threads": _int_parser(_int_check(1, _MAX_THREADS)),
    "lease_ms": _int_parser(_int_check(0, _MAX_LEASE_MS)),
    "backend": _choice_parser(BACKENDS),
    "redis_username": _parse_text,
    "redis_password": _parse_secret,
    "redis_mode": _choice_parser(REDIS_MODES),
    "redis_read_from_replicas": _parse_bool,
    "redis_tls_ca": _parse_text,
    "redis_tls_cert": _parse_text,
    "redis_tls_key": _parse_text,
}
assert set(_PARSERS) == CONFIG_KEYS  # a new field needs a parser


# --- loading ------------------------------------------------------------------------------------

_warned_env: set[str] = set()


def _read_yaml(path: str) -> dict[str, Any]:
    source = f"{CONFIG_ENV}={path}"
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(None, source, f"cannot read the file: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        # The YAML error text can quote the offending line (which might hold the key); keep
        # only the position.
        mark = getattr(e, "problem_mark", None)
        pos = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(None, source, f"not valid YAML{pos}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(None, source, f"must be a mapping of settings, got {type(data).__name__}")
    for k in data:
        if not isinstance(k, str) or k not in CONFIG_KEYS:
            raise ConfigError(str(k), source, _unknown_hint())
    return data


def _unknown_hint() -> str:
    return f"unknown setting; known settings are: {', '.join(sorted(CONFIG_KEYS))}"


def _env_layer(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    layer: dict[str, tuple[Any, str]] = {}
    known_env = {env_name(k): k for k in CONFIG_KEYS}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = known_env.get(name)
        if key is None:
            if name not in NON_CLIENT_ENV and name not in _warned_env:
                # Not an error: other tools and the server share the MEMKV_ prefix.
                _warned_env.add(name)
                log.warning("ignoring unknown environment variable %s (not a memkv setting)", name)
            continue
        if value.strip() == "":
            continue  # empty = unset, as for the server's flags
        layer[key] = (value, name)
    return layer


def load_config(
    overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> MemKVConfig:
    """Build the settings from overrides, the ``MEMKV_CONFIG`` file, ``MEMKV_*`` and defaults.

    ``env`` defaults to ``os.environ`` (tests pass a dict). ``overrides`` keys are setting names;
    a value of None means "not set here". Unknown keys in the file or in ``overrides`` raise;
    unknown ``MEMKV_*`` variables only log a warning.
    """
    env = os.environ if env is None else env
    layers: list[dict[str, tuple[Any, str]]] = [_env_layer(env)]

    path = env.get(CONFIG_ENV, "").strip()
    if path:
        source = f"{CONFIG_ENV}={path}"
        layers.append({k: (v, source) for k, v in _read_yaml(path).items() if v is not None})

    if overrides:
        layer: dict[str, tuple[Any, str]] = {}
        for k, v in overrides.items():
            if k not in CONFIG_KEYS:
                raise ConfigError(str(k), "overrides", _unknown_hint())
            if v is not None:
                layer[k] = (v, "overrides")
        layers.append(layer)

    chosen: dict[str, tuple[Any, str]] = {}
    for layer in layers:  # later layers win
        chosen.update(layer)

    values: dict[str, Any] = {}
    for key, (raw, source) in chosen.items():
        try:
            values[key] = _PARSERS[key](raw)
        except ValueError as e:
            raise ConfigError(key, source, str(e)) from None
    sources = tuple((k, chosen[k][1]) for k in sorted(chosen))
    if "servers" in values:
        # Which spelling the servers need depends on the backend: say where they came from.
        try:
            _check_servers_for(values.get("backend", "memkv"), values["servers"])
        except ValueError as e:
            raise ConfigError("servers", chosen["servers"][1], str(e)) from None
    return MemKVConfig(**values, sources=sources)
