"""What compat translates, checked against the installed vLLM through the real manager: the
OffloadKey layout, ScheduleEndContext's preempted requests, back-pressure wiring, the spec
registration, and the private fields and hooks compat reaches (the pool region's file, the
worker's shutdown), which must fail loudly if vLLM changes them."""

from __future__ import annotations

import os
import uuid

import pytest
from harness import okey
from specs import tiering_spec

import memkv_vllm
from memkv_vllm import TIERING_SPEC
from memkv_vllm.core.keys import KeyLayout
from memkv_vllm.vllm import compat
from memkv_vllm.vllm.compat import api
from memkv_vllm.vllm.tiering_spec import MemKVTieringOffloadingSpec


def _cfg(address: str, **kw) -> dict:
    return {"servers": [address], "prefix": f"test-{uuid.uuid4().hex[:8]}", **kw}


@pytest.mark.parametrize("hash_len", [32, 16])  # sha256* and xxhash* block hashes
def test_offload_keys_split_into_hash_and_group(hash_len: int) -> None:
    a = api()
    h = bytes(range(hash_len))
    key = a.make_offload_key(h, 3)
    assert a.split_offload_key(key) == (h, 3)
    layout = KeyLayout(prefix="kv", model="m", fields={"dtype": "float32"})
    assert layout.key(*a.split_offload_key(key)) == layout.key(h, 3)


def test_lookups_of_preempted_requests_are_not_probed(memkv_server, engines) -> None:
    b = engines(_cfg(memkv_server.address))
    kept, preempted = b.ctx(), b.ctx()
    for ctx in (kept, preempted):
        b.manager.on_new_request(ctx)
    lr = api().LookupResult
    assert b.lookup(okey(1), kept) is lr.RETRY
    assert b.lookup(okey(2), preempted) is lr.RETRY
    assert b.lookup(okey(3), preempted) is lr.RETRY
    assert b.lookup(okey(3), kept) is lr.RETRY  # asked by a running request too: still probed
    b.manager.on_schedule_end(api().schedule_end_context(preempted_req_ids=[preempted.req_id]))
    st = b.tier.store_stats()
    assert (st["probes"], st["probe_keys"], st["lookups_cancelled"]) == (1, 2, 1)
    # The preempted request comes back later: its key is queued and probed then.
    assert b.lookup(okey(2), preempted) is lr.RETRY
    b.run_until(lambda: b.lookup(okey(2), preempted) is lr.MISS, timeout=5)


def test_the_back_pressure_detector_reaches_the_tier(memkv_server, engines) -> None:
    if compat.detect().name < "0.31":
        pytest.skip("vLLM < 0.31 has no back-pressure detector")
    b = engines(_cfg(memkv_server.address,
                     backpressure={"backpressure_cls": "EMABackpressureDetector"}))
    # The manager reads tier.bp_detector before each cascade; the base class must have it.
    assert b.tier.bp_detector is not None
    assert type(b.tier.bp_detector).__name__ == "EMABackpressureDetector"


def test_register_adds_the_memkv_spec_and_leaves_vllms_own_alone() -> None:
    a = api()
    memkv_vllm.register()  # as vLLM's plugin loader does (the harness did too: idempotent)
    # vLLM's own test_tiering_spec_registered, through vLLM's public lookup: an engine that names
    # vLLM's spec gets vLLM's class, plugin or not.
    assert a.spec_class({"spec_name": "TieringOffloadingSpec"}) is a.tiering_spec_class()
    assert a.spec_class({"spec_name": "CPUOffloadingSpec"}).__module__.startswith("vllm.")
    cls = a.spec_class({"spec_name": TIERING_SPEC})
    assert cls is MemKVTieringOffloadingSpec and cls.__name__ == TIERING_SPEC
    assert issubclass(cls, a.tiering_spec_class())


def test_the_pool_regions_file_fields_are_where_compat_reads_them() -> None:
    # compat reads and writes SharedOffloadRegion's file fields, one of them private (_creator):
    # a vLLM that renamed them fails here, and a cleanup() that stopped honouring the flag too.
    a = api()
    spec = tiering_spec()
    worker = a.open_worker_region(spec, 0)  # creates the file
    path = worker.mmap_path
    try:
        file = a.pool_file(worker)
        assert file is not None and (file.path, file.creator) == (path, True)
        assert os.fstat(file.fd).st_ino == os.stat(path).st_ino
        scheduler = a.open_worker_region(spec, 0)  # a second mapping joins the file
        assert a.pool_file(scheduler).creator is False
        scheduler.cleanup()
        assert a.pool_file(scheduler) is None  # closed
        a.keep_name_at_cleanup(worker)
        worker.cleanup()
        assert os.path.exists(path)  # the creator's cleanup left the name
    finally:
        if os.path.exists(path):
            os.unlink(path)
    with pytest.raises(RuntimeError, match="mmap_path, fd, _creator"):
        a.pool_file(object())
    with pytest.raises(RuntimeError, match="_creator"):
        a.keep_name_at_cleanup(object())


def test_the_shutdown_hook_runs_before_an_offloading_workers_shutdown() -> None:
    calls = []

    class Worker(api().direct_base_classes().worker):  # vLLM's OffloadingWorker
        def submit_store(self, *args):
            return True

        def submit_load(self, *args):
            return True

        def get_finished(self):
            return []

        def wait(self, job_ids):
            return None

        def shutdown(self):
            calls.append("shutdown")

    w = Worker()
    api().call_before_shutdown(w, lambda: calls.append("hook"))
    w.shutdown()
    assert calls == ["hook", "shutdown"]
    with pytest.raises(RuntimeError, match="not an OffloadingWorker"):
        api().call_before_shutdown(object(), lambda: None)


def test_the_detected_adapter_is_the_newest_whose_probe_passes() -> None:
    detected = compat.detect()
    gens = compat.generations()
    assert detected.probe()
    assert not any(g.probe() for g in gens[:gens.index(detected)])
    assert all(g.probe() for g in gens[gens.index(detected):])

