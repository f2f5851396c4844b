"""The recompute route: vLLM's OffloadingConnector, except that a failed load is recomputed.

vLLM's OffloadingConnector asserts that every transfer its offloading worker reports succeeded: a
load that failed (server killed, frozen past its timeout, value gone) kills the engine, and
vLLM's `kv_load_failure_policy` never applies because that connector reports no failed blocks.
`MemKVOffloadingConnector` is that connector with the one hook vLLM does offer wired in. It is
selected in --kv-transfer-config only (nothing else changes):

    {"kv_connector": "MemKVOffloadingConnector", "kv_connector_module_path": "memkv_vllm.connector",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"spec_name": "MemKVOffloadingSpec",
                                   "spec_module_path": "memkv_vllm.spec", ...}}

The connector and the spec meet through two Protocols of memkv_vllm.core.interface, which
MemKVOffloadingSpec's manager and worker implement (a spec whose parts do not is refused at
start-up: nothing else could name the blocks of its failed loads):

* on each worker, once vLLM made the spec's worker, the connector switches it to recompute
  (`LoadErrorReporter.recompute_failed_loads`): the worker then answers a failed load as a
  success and keeps its unwritten blocks, which the connector hands to vLLM's scheduler through
  `get_block_ids_with_load_errors()` (`take_load_errors`), in the same step as the job. With
  `kv_load_failure_policy: "recompute"` the scheduler truncates the request at its first failed
  block and recomputes from there; with "fail" (vLLM's default) it finishes the request with an
  error. Either way the engine lives.
* on the scheduler, when the workers' load errors arrive, the connector tells the spec's manager
  (`LoadErrorListener.on_load_errors`) before the failed jobs complete.

This module does not import vLLM and names none of its attributes: compat/ builds the class on
first use, wiring vLLM's connector hooks to `RecomputeRoute`'s methods, and reads vLLM's objects.
"""

from __future__ import annotations

import logging
from typing import Any

from memkv_vllm.core.interface import LoadErrorListener, LoadErrorReporter
from memkv_vllm.vllm.compat import api

logger = logging.getLogger("vllm.memkv.connector")

CONNECTOR_NAME = "MemKVOffloadingConnector"


def _refuse(part: str, obj: object, protocol: type) -> RuntimeError:
    return RuntimeError(
        f"{CONNECTOR_NAME}: the offloading spec's {part} ({type(obj).__name__}) does not "
        f"implement {protocol.__name__}, so the blocks of its failed loads cannot be "
        f"recomputed; use spec_name MemKVOffloadingSpec, or vLLM's OffloadingConnector")


class RecomputeRoute:
    """The part of MemKVOffloadingConnector that is not vLLM's OffloadingConnector (a mixin in
    front of it; compat's `recompute_connector_class` calls these methods from vLLM's hooks)."""

    _reporter: LoadErrorReporter | None = None  # worker side, once the KV caches are registered
    _listener: LoadErrorListener | None = None  # scheduler side

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any, *args: Any,
                 **kwargs: Any) -> None:
        adapter = api()
        missing = adapter.load_error_hook_missing()
        if missing:
            raise RuntimeError(f"{CONNECTOR_NAME}: this vLLM cannot recompute failed loads "
                               f"({missing}); use vLLM's OffloadingConnector instead")
        groups = adapter.kv_cache_group_count(kv_cache_config)
        if groups > 1:
            # vLLM maps reported block ids back to requests only with one KV-cache group (newer
            # versions raise, older ones fail to unpack): a failed load would then kill the
            # engine.
            raise RuntimeError(f"{CONNECTOR_NAME}: this model has {groups} KV-cache groups; "
                               "vLLM recomputes failed loads by block id only for models with "
                               "one group. Use vLLM's OffloadingConnector instead")
        super().__init__(vllm_config, role, kv_cache_config, *args, **kwargs)  # type: ignore[call-arg]  # a mixin: vLLM's connector is next in the MRO
        manager = adapter.offloading_manager(self)
        if manager is not None:  # the scheduler's side
            if not isinstance(manager, LoadErrorListener):
                raise _refuse("manager", manager, LoadErrorListener)
            self._listener = manager
            policy = adapter.load_failure_policy(vllm_config)
            what = {"recompute": "recomputes their tokens",
                    "fail": "finishes their requests with an error"}.get(policy, policy)
            logger.info("memkv: %s: a failed KV load is reported to vLLM, whose "
                        "kv_load_failure_policy=%r %s; the engine keeps running",
                        CONNECTOR_NAME, policy, what)

    def kv_caches_registered(self) -> None:
        """Worker side, once vLLM made the spec's worker: switch it to recompute."""
        worker = api().offloading_worker(self)
        if worker is None or self._reporter is not None:
            return
        if not isinstance(worker, LoadErrorReporter):
            raise _refuse("worker", worker, LoadErrorReporter)
        worker.recompute_failed_loads()
        self._reporter = worker

    def load_error_block_ids(self) -> set[int]:
        """Worker side: the blocks of failed loads since the last call, for vLLM's scheduler."""
        return self._reporter.take_load_errors() if self._reporter is not None else set()

    def load_errors_reported(self) -> None:
        """Scheduler side: the workers' load errors arrived, in the same output as the completion
        of their jobs. Before those complete, tell the spec's manager (memkv's answers lookups
        from a verdict cache), so the recomputed request's next lookup does not find the same
        blocks again and load them again, and again, for as long as the cache holds a HIT."""
        if self._listener is not None:
            self._listener.on_load_errors()


_class: type | None = None


def connector_class() -> type:
    """MemKVOffloadingConnector: RecomputeRoute in front of the installed vLLM's
    OffloadingConnector (built once per process)."""
    global _class
    if _class is None:
        _class = api().recompute_connector_class(RecomputeRoute, CONNECTOR_NAME, __name__)
    return _class


def __getattr__(name: str) -> Any:
    # vLLM resolves the connector with getattr(module, kv_connector); building the class needs
    # vLLM, so it happens then and not at import.
    if name == CONNECTOR_NAME:
        return connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
