"""Network faults between the client and memkv servers on hosts of their own (network namespaces
joined by veth pairs: tests/netns_hosts.py), with the real client.

What each test shows, for a partition (a blackhole route: packets vanish, no RST, connects hang),
a server restarted empty, and servers added and removed under traffic:

* no call waits longer than the client's deadline: one `op_timeout_s` for the whole call, the
  connects inside it bounded by `connect_timeout_s` (OP_S and CONNECT_S here); once a server failed
  it is marked down (backoff 0.1 s doubling to 5 s) and its keys answer at once;
* every answer is a hit with the stored bytes, a miss or an error: never other bytes;
* once the route is restored, hits come back with the same client and servers, nothing
  restarted (within the 5 s backoff ceiling).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from memkv_vllm.core.client import MemKVClient, Status
from memkv_vllm.core.config import load_config
from memkv_vllm.core.interface import Completion, Lookup
from memkv_vllm.core.store import BlockStore, StoreOptions

pytestmark = pytest.mark.slow

CONNECT_S, OP_S = 0.5, 1.5
# What the box adds to a deadline: thread wake-up and scheduling on 2 shared cores.
SLACK_S = 1.0
VALUE = 4096
HEAL_WITHIN_S = 5.0 + OP_S + 5.0  # backoff ceiling, one call, a loaded box


def value_of(key: bytes) -> np.ndarray:
    return np.frombuffer(hashlib.shake_128(key).digest(VALUE), dtype=np.uint8)


def client_for(hosts: Sequence) -> MemKVClient:
    return MemKVClient(load_config({"servers": [h.address for h in hosts],
                                    "connect_timeout_s": CONNECT_S, "op_timeout_s": OP_S},
                                   env={}))


class Reads:
    """Reads keys and checks every answer: a hit holds the key's bytes; records the worst wait."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys = list(keys)
        self.bufs = [np.empty(VALUE, dtype=np.uint8) for _ in self.keys]
        self.worst_s = 0.0

    def read(self, client: MemKVClient) -> list[Status]:
        for b in self.bufs:
            b.fill(0xA5)  # a destination not answered OK is never looked at
        t0 = time.monotonic()
        st = client.get_into(self.keys, self.bufs)
        self.worst_s = max(self.worst_s, time.monotonic() - t0)
        for k, s, b in zip(self.keys, st, self.bufs, strict=True):
            if s == Status.OK:
                assert np.array_equal(b, value_of(k)), f"wrong bytes for {k!r}"
        return st


def store(client: MemKVClient, keys: Sequence[bytes]) -> list[Status]:
    return client.put(list(keys), [value_of(k) for k in keys])


@pytest.fixture
def three(net_hosts) -> Iterator[list]:
    hosts = [net_hosts.add() for _ in range(3)]
    for h in hosts:
        h.serve()
    yield hosts


def test_a_blackholed_server_costs_at_most_the_deadline_and_heals(three) -> None:
    client = client_for(three)
    keys = [f"part/{i}".encode() for i in range(240)]
    assert set(store(client, keys)) == {Status.OK}
    victim = three[1]
    cut = {k for k in keys if client.server_of(k) == victim.address}
    assert 40 < len(cut) < 160  # rendezvous spreads them
    reads = Reads(keys)
    victim.blackhole()
    seen: set[Status] = set()
    writes_worst = 0.0
    until = time.monotonic() + 3 * OP_S
    while time.monotonic() < until:  # traffic through the partition
        st = reads.read(client)
        for k, s in zip(keys, st, strict=True):
            assert (s == Status.OK) == (k not in cut), (k, s)  # its keys fail, only its keys
            if k in cut:
                seen.add(s)
        t0 = time.monotonic()
        store(client, [f"part/new/{i}".encode() for i in range(20)])
        writes_worst = max(writes_worst, time.monotonic() - t0)
    fresh = client_for(three)  # a new process's client: its connects to the victim hang
    reads.read(fresh)
    fresh.close()
    print(f"partition: worst read {reads.worst_s:.3f} s, worst write {writes_worst:.3f} s, "
          f"statuses of the cut keys {sorted(s.name for s in seen)}")
    assert Status.TIMEOUT in seen  # the silence ran into the deadline at least once
    assert reads.worst_s <= OP_S + SLACK_S, reads.worst_s
    assert writes_worst <= OP_S + SLACK_S, writes_worst
    victim.heal()
    deadline = time.monotonic() + HEAL_WITHIN_S
    healed = time.monotonic()
    while set(reads.read(client)) != {Status.OK}:  # same client, same servers
        assert time.monotonic() < deadline, "hits did not come back after the route healed"
        time.sleep(0.1)
    print(f"partition: every key a hit again {time.monotonic() - healed:.2f} s after the heal")
    assert victim.server is not None and victim.server.alive()
    client.close()


def test_a_server_restarted_empty_answers_misses_then_hits_again(three) -> None:
    client = client_for(three)
    keys = [f"restart/{i}".encode() for i in range(240)]
    assert set(store(client, keys)) == {Status.OK}
    victim = three[2]
    cut = [k for k in keys if client.server_of(k) == victim.address]
    reads = Reads(keys)
    victim.stop_server()
    victim.serve()  # same address, nothing in it
    deadline = time.monotonic() + HEAL_WITHIN_S
    while True:
        st = dict(zip(keys, reads.read(client), strict=True))
        assert all(st[k] == Status.OK for k in keys if k not in cut)
        if all(st[k] == Status.NOT_FOUND for k in cut):
            break  # reconnected: misses, not errors, and never the old bytes from elsewhere
        assert time.monotonic() < deadline, {st[k] for k in cut}
        time.sleep(0.1)
    print(f"restart: worst read {reads.worst_s:.3f} s")
    assert set(store(client, cut)) == {Status.OK}  # the engine writes them back
    assert set(reads.read(client)) == {Status.OK}
    assert reads.worst_s <= OP_S + SLACK_S
    client.close()


class Traffic(threading.Thread):
    """Reads `keys` in a loop through whichever client `use` installed last, checking bytes."""

    def __init__(self, keys: Sequence[bytes], client: MemKVClient) -> None:
        super().__init__(daemon=True)
        self.reads = Reads(keys)
        self.client = client
        self.rounds = 0
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                self.reads.read(self.client)
                self.rounds += 1
        except BaseException as e:  # surfaced by finish()
            self.error = e

    def finish(self) -> None:
        self._stop_event.set()
        self.join(30)
        if self.error is not None:
            raise self.error


def hit_share(client: MemKVClient, keys: Sequence[bytes]) -> float:
    return Reads(keys).read(client).count(Status.OK) / len(keys)


def test_servers_added_and_removed_under_traffic(net_hosts, three) -> None:
    keys = [f"grow/{i}".encode() for i in range(600)]
    old = client_for(three)
    assert set(store(old, keys)) == {Status.OK}
    traffic = Traffic(keys, old)
    traffic.start()
    try:
        fourth = net_hosts.add()
        fourth.serve()  # joins while the old list keeps serving
        grown = client_for([*three, fourth])
        kept = hit_share(grown, keys)
        assert 0.75 - 0.08 < kept < 0.75 + 0.08  # (N-1)/N of the keys stay where they were
        moved = [k for k in keys if grown.server_of(k) == fourth.address]
        assert set(store(grown, moved)) == {Status.OK}  # recomputed and written back
        traffic.client = grown
        assert hit_share(grown, keys) == 1.0
        removed = three[0]
        removed.stop_server()  # dies under traffic: its keys fail, the others keep hitting
        st = dict(zip(keys, Reads(keys).read(grown), strict=True))
        assert all((s == Status.OK) == (grown.server_of(k) != removed.address)
                   for k, s in st.items())
        shrunk = client_for([three[1], three[2], fourth])
        traffic.client = shrunk
        assert 0.75 - 0.08 < hit_share(shrunk, keys) < 0.75 + 0.08
    finally:
        traffic.finish()
    print(f"membership: {traffic.rounds} read rounds under traffic, worst "
          f"{traffic.reads.worst_s:.3f} s")
    assert traffic.rounds > 0
    assert traffic.reads.worst_s <= OP_S + SLACK_S
    for c in (old, grown, shrunk):
        c.close()


def lookups(bs: BlockStore, keys: Sequence[bytes]) -> dict[bytes, tuple[Lookup, float]]:
    """Each key's verdict and the seconds it took to come, stepping the store as a scheduler
    does (lookup, then flush)."""
    out: dict[bytes, tuple[Lookup, float]] = {}
    t0 = time.monotonic()
    deadline = t0 + 3 * OP_S + SLACK_S
    while len(out) < len(keys):
        assert time.monotonic() < deadline, "lookups stayed pending past the lookup timeout"
        for k in keys:
            if k not in out and (v := bs.lookup(k)) is not Lookup.PENDING:
                out[k] = (v, time.monotonic() - t0)
        bs.flush_lookups()
        time.sleep(0.01)
    return out


def load(bs: BlockStore, job_id: int, keys: Sequence[bytes], dst: np.ndarray) -> Completion:
    dst.fill(0xA5)
    bs.submit_load(job_id, keys, [int(dst[i].ctypes.data) for i in range(len(keys))],
                   [VALUE] * len(keys))
    deadline = time.monotonic() + 2 * OP_S + SLACK_S
    while not (done := bs.poll()):
        assert time.monotonic() < deadline, "load job did not complete"
        bs.wait_any(0.05)
    (c,) = done
    for i, k in enumerate(keys):
        if k in c.ok_keys:
            assert np.array_equal(dst[i], value_of(k)), f"wrong bytes for {k!r}"
    return c


@pytest.mark.parametrize("lookup_timeout_s", [OP_S / 2, 2 * OP_S])
def test_the_block_store_through_a_partition(three, lookup_timeout_s: float) -> None:
    """The engines' layer: lookups of the black-holed server's keys answer MISS and its loads
    fail, each within the deadlines; the other servers' keys hit at once, from the very first
    lookup, whether the lookup timeout is shorter or longer than the op deadline (the store
    probes each server on its own), and load their bytes; after the heal the same store hits
    and loads everything again."""
    client = client_for(three)
    keys = [f"store/{i}".encode() for i in range(96)]
    assert set(store(client, keys)) == {Status.OK}
    victim = three[0]
    cut = {k for k in keys if client.server_of(k) == victim.address}
    bs = BlockStore(client.codes, StoreOptions(
        n_read_threads=2, n_write_threads=1, lookup_timeout_s=lookup_timeout_s, miss_ttl_s=0.3,
        failed_load_miss_ttl_s=0.0))
    dst = np.zeros((len(keys), VALUE), dtype=np.uint8)
    bs.register_buffer(int(dst.ctypes.data), dst.nbytes, owner=dst)
    victim.blackhole()
    verdicts = lookups(bs, keys)
    hits = {k for k, (v, _) in verdicts.items() if v is Lookup.HIT}
    assert hits == set(keys) - cut  # the first probe: the live servers' answers, only those
    live_s = max(t for k, (_, t) in verdicts.items() if k in hits)
    silent_s = max(t for k, (_, t) in verdicts.items() if k in cut)
    print(f"partition, lookup timeout {lookup_timeout_s:g} s: the live servers' hits in "
          f"{live_s:.3f} s, the silent server's misses in {silent_s:.3f} s")
    # The live servers answer at network speed, not at a deadline; the silent one's keys at the
    # earlier of the lookup timeout and the op deadline.
    assert live_s < min(lookup_timeout_s, OP_S) / 2, live_s
    assert silent_s <= min(lookup_timeout_s, OP_S) + SLACK_S, silent_s
    t0 = time.monotonic()
    c = load(bs, 1, keys, dst)
    assert time.monotonic() - t0 <= OP_S + SLACK_S
    assert not c.ok and set(c.ok_keys) == set(keys) - cut
    victim.heal()
    deadline = time.monotonic() + HEAL_WITHIN_S
    job = 2
    while not load(bs, job, keys, dst).ok:  # same store, same client
        assert time.monotonic() < deadline, "loads did not come back after the route healed"
        job += 1
        time.sleep(0.1)
    bs.unregister_buffer(int(dst.ctypes.data))
    bs.close()
    client.close()
