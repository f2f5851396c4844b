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

On each worker, `LoadFailureGuard` stands between vLLM's connector worker and the spec's
offloading worker. It answers every finished job as a success (what the connector asserts) and
keeps the destination block ids of the loads that failed, which the connector then hands to
vLLM's scheduler through `get_block_ids_with_load_errors()`. With
`kv_load_failure_policy: "recompute"` the scheduler truncates the request at its first failed
block and recomputes from there; with "fail" (vLLM's default) it finishes the request with an
error. Either way the engine lives. On the scheduler side, the connector tells the spec's manager
(`on_load_errors()`, where it has one) before the failed jobs complete.

The guard works with any spec's worker: a worker that reports a failed load job as
`success=False` has all of that job's blocks recomputed; a worker that also says which blocks
failed (`take_failed_block_ids()`, as memkv's does) has only those recomputed.

This module does not import vLLM and names none of its attributes: compat/ builds the class on
first use, wiring vLLM's connector hooks to `RecomputeRoute`'s methods, and reads vLLM's objects.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from memkv_vllm.vllm.compat import api

logger = logging.getLogger("vllm.memkv.connector")

CONNECTOR_NAME = "MemKVOffloadingConnector"


class LoadFailureGuard:
    """Wraps a spec's OffloadingWorker: failed jobs become successes, failed loads' blocks are kept.

    Called only by vLLM's connector worker, on the worker's thread. Every call is forwarded to the
    wrapped worker; `get_finished()` rewrites results and `take_load_errors()` hands out the block
    ids of failed loads (each id once). vLLM's specs and results are read through `adapter`
    (compat's `VllmAdapter`: `gpu_job`, `transfer_outcome`, `transfer_succeeded_empty`).
    """

    def __init__(self, inner: Any, adapter: Any) -> None:
        self._inner = inner
        self._api = adapter
        # Where the worker itself names failed blocks (memkv's worker does), only those are
        # recomputed; otherwise a failed load job loses all its blocks.
        self._take_failed: Callable[[], Iterable[int]] | None = getattr(
            inner, "take_failed_block_ids", None)
        self._loads: dict[int, frozenset[int]] = {}  # in-flight load job -> destination blocks
        # Failed ids the worker named while their job was still in flight: reported with the job,
        # when vLLM's scheduler is sure to still see the request waiting for that load.
        self._early: set[int] = set()
        self._errors: set[int] = set()  # for the next get_block_ids_with_load_errors()
        self.failed_loads = 0  # jobs, since start (logged at shutdown)
        self.failed_stores = 0

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return bool(self._inner.submit_store(job_id, src_spec, dst_spec))

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, **kwargs: Any) -> bool:
        # kwargs: vLLM 0.33's `expedited`, passed on only when vLLM passes it.
        self._loads[job_id] = frozenset(self._api.gpu_job(dst_spec)[0])
        return bool(self._inner.submit_load(job_id, src_spec, dst_spec, **kwargs))

    def get_finished(self) -> list[Any]:
        a = self._api
        results = list(self._inner.get_finished())
        named = set(self._take_failed()) if self._take_failed is not None else set()
        out = []
        for result in results:
            job_id, success = a.transfer_outcome(result)
            blocks = self._loads.pop(job_id, None)
            if blocks is None:  # a store
                if not success:
                    # vLLM would assert; the spec's lookups never claim a value it did not commit.
                    self.failed_stores += 1
                    logger.warning("memkv: store job %d failed; its blocks stay uncached", job_id)
                    result = a.transfer_succeeded_empty(result)
                out.append(result)
                continue
            failed = blocks & (named | self._early)
            self._early -= blocks
            if not success:
                failed = failed or blocks
                result = a.transfer_succeeded_empty(result)
            if failed:
                self.failed_loads += 1
                self._errors |= failed
                logger.warning("memkv: load job %d failed for %d of its %d blocks; vLLM's "
                               "kv_load_failure_policy applies to them", job_id, len(failed),
                               len(blocks))
            out.append(result)
        if named:
            in_flight = set().union(*self._loads.values()) if self._loads else set()
            self._early |= named & in_flight  # anything else belongs to no load of ours
        return out

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def wait(self, job_ids: set[int]) -> None:
        self._inner.wait(job_ids)

    def shutdown(self) -> None:
        if self.failed_loads or self.failed_stores:
            logger.info("memkv: %d failed load jobs handed to vLLM's kv_load_failure_policy and "
                        "%d failed store jobs since start", self.failed_loads, self.failed_stores)
        self._inner.shutdown()


class RecomputeRoute:
    """The part of MemKVOffloadingConnector that is not vLLM's OffloadingConnector (a mixin in
    front of it; compat's `recompute_connector_class` calls these methods from vLLM's hooks)."""

    _guard: LoadFailureGuard | None = None

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any, *args: Any,
                 **kwargs: Any) -> None:
        adapter = api()
        missing = adapter.load_error_hook_missing()
        if missing:
            raise RuntimeError(f"{CONNECTOR_NAME}: this vLLM cannot recompute failed loads "
                               f"({missing}); use vLLM's OffloadingConnector instead")
        groups = adapter.kv_cache_group_count(kv_cache_config)
        if groups > 1:
            # vLLM maps reported block ids back to requests only with one KV-cache group (0.32+
            # raises, older versions fail to unpack): a failed load would then kill the engine.
            raise RuntimeError(f"{CONNECTOR_NAME}: this model has {groups} KV-cache groups; "
                               "vLLM recomputes failed loads by block id only for models with "
                               "one group. Use vLLM's OffloadingConnector instead")
        super().__init__(vllm_config, role, kv_cache_config, *args, **kwargs)  # type: ignore[call-arg]
        if adapter.offloading_manager(self) is not None:  # the scheduler's side
            policy = adapter.load_failure_policy(vllm_config)
            what = {"recompute": "recomputes their tokens",
                    "fail": "finishes their requests with an error"}.get(policy, policy)
            logger.info("memkv: %s: a failed KV load is reported to vLLM, whose "
                        "kv_load_failure_policy=%r %s; the engine keeps running",
                        CONNECTOR_NAME, policy, what)

    def kv_caches_registered(self) -> None:
        """Worker side, once vLLM made the spec's worker: put the guard in front of it."""
        adapter = api()
        inner = adapter.offloading_worker(self)
        if inner is None or self._guard is not None:
            return
        if hasattr(inner, "recompute_failed_loads"):
            # memkv's worker: report failed loads as successes and name their blocks (with
            # vLLM's plain connector it must report them failed, which stops the engine).
            inner.recompute_failed_loads = True
        self._guard = LoadFailureGuard(inner, adapter)
        adapter.replace_offloading_worker(self, self._guard)

    def load_error_block_ids(self) -> set[int]:
        """Worker side: the blocks of failed loads since the last call, for vLLM's scheduler."""
        return self._guard.take_load_errors() if self._guard is not None else set()

    def load_errors_reported(self) -> None:
        """Scheduler side: the workers' load errors arrived, in the same output as the completion
        of their jobs. Before those complete, tell the spec's manager (memkv's answers lookups
        from a verdict cache), so the recomputed request's next lookup does not find the same
        blocks again and load them again, and again, for as long as the cache holds a HIT."""
        hook = getattr(api().offloading_manager(self), "on_load_errors", None)
        if hook is not None:
            hook()


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
