"""`MemKVTieringOffloadingSpec`: vLLM's TieringOffloadingSpec, with a CPU pool whose /dev/shm name
goes once every process mapped it and, on vLLM's CPU platform, a copy worker.

Engines opt in by name (`"spec_name": "MemKVTieringOffloadingSpec"` in kv_connector_extra_config),
which register() adds to vLLM's spec factory through its public `register_spec`; vLLM's own
"TieringOffloadingSpec" stays vLLM's class (docs/tier.md, "Which spec"). The memkv tier works
under either: everything a tier sees (manager, CPU primary tier, secondary tiers, metrics) is
upstream's, and only two things differ here:

* the scheduler unlinks the pool's name after mapping it (shm_region.py says why that is safe),
  and a worker's shutdown then leaves a newer engine's file of the same name alone;
* on the CPU platform, where upstream's worker refuses to start, the worker is cpu_worker.py's.

Imported only where an engine names the spec (vLLM's factory loads it lazily): it imports vLLM.
"""

from __future__ import annotations

from typing import Any

from memkv_vllm.vllm.compat import api
from memkv_vllm.vllm.cpu_worker import cpu_platform_worker
from memkv_vllm.vllm.shm_region import drop_pool_name, forget_dropped_name_at_shutdown

_API = api()


class MemKVTieringOffloadingSpec(_API.tiering_spec_class()):  # type: ignore[misc]  # base made by compat
    """vLLM's TieringOffloadingSpec with the two changes of the module doc."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # the generation's constructor arguments, as given
        self._memkv_worker: Any = None

    def get_manager(self) -> Any:
        manager = super().get_manager()
        # The scheduler maps the pool last: its name can go now.
        drop_pool_name(_API.scheduler_region(self))
        return manager

    def get_worker(self, kv_caches: Any) -> Any:
        if self._memkv_worker is None:
            if _API.is_cpu_platform():
                self._memkv_worker = cpu_platform_worker(self, kv_caches)
            else:
                self._memkv_worker = super().get_worker(kv_caches)
                forget_dropped_name_at_shutdown(self._memkv_worker)
        return self._memkv_worker
