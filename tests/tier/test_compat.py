"""What compat translates, checked against the installed vLLM through the real manager: the
OffloadKey layout, ScheduleEndContext's preempted requests, back-pressure wiring, and the one
private hook (the built-in spec swap), which must fail loudly if vLLM changes it."""

from __future__ import annotations

import uuid

import pytest
from harness import okey

from memkv_vllm.core.keys import KeyLayout
from memkv_vllm.vllm import compat
from memkv_vllm.vllm.compat import api
from memkv_vllm.vllm.cpu_worker import cpu_tiering_spec_class, install
from memkv_vllm.vllm.shm_region import tiering_spec_class


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


def test_the_plugins_spec_replaces_the_builtin_one_on_every_platform() -> None:
    a = api()
    # register() (harness) installed it; this reads vLLM's private registry through the same
    # adapter hook, so a vLLM that changed the registry fails here. The CPU platform gets the
    # copy worker; every platform the pool whose /dev/shm name goes early (test_shm_pool.py).
    assert install()
    cls = a.resolve_builtin_spec("TieringOffloadingSpec")
    assert cls is (cpu_tiering_spec_class() if a.is_cpu_platform() else tiering_spec_class())
    assert issubclass(cls, tiering_spec_class())
    assert issubclass(tiering_spec_class(), a.tiering_spec_class())


def test_the_spec_swap_refuses_a_registry_it_does_not_recognise() -> None:
    with pytest.raises(RuntimeError, match="no longer maps 'NoSuchSpec'"):
        api().replace_builtin_spec("NoSuchSpec", cpu_tiering_spec_class)


def test_the_detected_adapter_is_the_newest_whose_probe_passes() -> None:
    detected = compat.detect()
    gens = compat.generations()
    assert detected.probe()
    assert not any(g.probe() for g in gens[:gens.index(detected)])
    assert all(g.probe() for g in gens[gens.index(detected):])
