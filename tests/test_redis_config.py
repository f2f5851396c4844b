"""The Redis backend's settings in memkv_vllm.core.config: backend selection, redis:// server URLs,
credentials that never leak, and every MEMKV_REDIS_* variable."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from memkv_vllm.core.config import ConfigError, MemKVConfig, load_config, parse_redis_url


def test_env_selects_redis_with_every_setting() -> None:
    env = {
        "MEMKV_BACKEND": "Redis",
        "MEMKV_SERVERS": "redis://Node-1.Example.com:7000, redis://[2001:DB8::1]:7001",
        "MEMKV_REDIS_USERNAME": "kv",
        "MEMKV_REDIS_PASSWORD": "pa55",
        "MEMKV_REDIS_MODE": "CLUSTER",
        "MEMKV_REDIS_READ_FROM_REPLICAS": "yes",
        "MEMKV_REDIS_TLS_CA": "/etc/ca.pem",
        "MEMKV_REDIS_TLS_CERT": "/etc/c.pem",
        "MEMKV_REDIS_TLS_KEY": "/etc/k.pem",
    }
    c = load_config(env=env)
    assert c.backend == "redis"
    assert c.servers == ("redis://node-1.example.com:7000", "redis://[2001:db8::1]:7001")
    assert (c.redis_username, c.redis_password, c.redis_mode) == ("kv", "pa55", "cluster")
    assert c.redis_read_from_replicas is True
    assert (c.redis_tls_ca, c.redis_tls_cert, c.redis_tls_key) == (
        "/etc/ca.pem", "/etc/c.pem", "/etc/k.pem")


def test_redis_defaults_and_the_tier_dict_overrides(tmp_path: Path) -> None:
    assert MemKVConfig(backend="redis").servers == ("redis://127.0.0.1:6379",)
    assert load_config({"backend": "redis"}, env={}).servers == ("redis://127.0.0.1:6379",)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"backend": "redis", "servers": ["redis://a:1"],
                                    "redis_read_from_replicas": True}))
    c = load_config({"servers": "rediss://b"}, env={"MEMKV_CONFIG": str(path)})
    assert c.servers == ("rediss://b:6379",) and c.redis_read_from_replicas is True
    assert dict(c.sources)["servers"] == "overrides"


@pytest.mark.parametrize(("overrides", "message"), [
    ({"servers": "redis://a:1"}, "set backend: redis"),
    ({"backend": "redis", "servers": "a:1"}, "every server is a 'redis://host:port'"),
    ({"backend": "redis", "servers": "redis://a:1,rediss://b:2"}, "TLS is all or nothing"),
    ({"backend": "redis", "servers": "redis://a:1/3"}, "no database number"),
    ({"backend": "redis", "servers": "http://a:1"}, "must look like 'redis://host:port'"),
    ({"backend": "valkey"}, "must be one of memkv, redis"),
    ({"backend": "redis", "redis_mode": "sentinel"}, "must be one of auto, cluster, standalone"),
    ({"backend": "redis", "redis_read_from_replicas": "maybe"}, "must be true or false"),
])
def test_bad_redis_settings_name_the_key(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides, env={})
    assert message in str(info.value)
    assert info.value.source == "overrides"


def test_credentials_never_leak() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"backend": "redis", "servers": "redis://u:hunter2@a:1"}, env={})
    assert "hunter2" not in str(info.value) and "redis_password" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config({"backend": "redis", "redis_password": 12345}, env={})
    assert "12345" not in str(info.value)
    c = load_config({"backend": "redis", "redis_password": "hunter2"}, env={})
    assert "hunter2" not in repr(c) and "hunter2" not in c.describe()
    assert "password=set" in c.describe() and "<redacted>" in repr(c)


def test_parse_redis_url_canonical_forms() -> None:
    assert parse_redis_url("REDIS://Host.Example:6380/") == "redis://host.example:6380"
    assert parse_redis_url("rediss://[::1]") == "rediss://[::1]:6379"
    with pytest.raises(ValueError):
        parse_redis_url("redis://host:99999")
