"""Worker side of direct mode: vLLM's transfer jobs as `KVOffloader` jobs over the engine's KV.

A job names GPU blocks group-major (`group_sizes[g]` ids for KV-cache group g, the first of them
at request-logical index `block_indices[g]`) and, in the same order, the chunks they belong to
(block hash, key group). GPU block i of group g is sub-block `skip + i` of that group's run of
chunks, `skip = block_indices[g] % blocks_per_chunk` (vLLM's own CPU worker maps them the same
way). Each chunk is one value of this rank: `key_under(prefix, hash, group, rank)`.

Contracts with vLLM's OffloadingConnector, all kept here:
* `submit_*` never block and never raise (a malformed job is logged and finishes failed);
* `get_finished` answers every job exactly once, as a `FinishedJob`: plain facts, the blocks it
  did not move included;
* `wait` returns once the listed jobs no longer touch their blocks (stores copied out, loads
  written), jumping them ahead of queued work; after `wait_timeout_s` it gives them up
  (`KVOffloader.abandon`): a load then writes none of its blocks and counts as failed;
* a store finishes when its values are committed in the cluster or failed (its failed blocks
  cost a later miss, nothing else).

What a failed load becomes for vLLM (a reported failure, or a success whose blocks vLLM
recomputes) is not decided here but by `memkv_vllm.direct.load_failures.LoadFailurePolicy`.

Threads: vLLM's worker thread only. No vLLM imports.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import attrs

from memkv_vllm.direct.keys import key_under
from memkv_vllm.offload import Entry, KVOffloader
from memkv_vllm.offload.paged import chunks_spanned

logger = logging.getLogger("vllm.memkv_direct")


@attrs.frozen
class FinishedJob:
    """One job's answer, returned once by `DirectWorker.get_finished`."""

    job_id: int
    is_load: bool
    # Loads: destination blocks NOT written (their KV is what it was). Stores: blocks whose values
    # are not in the cluster.
    failed_block_ids: frozenset[int]
    nbytes: int  # value bytes that transferred
    seconds: float
    # The job could not be read, so which blocks it names is unknown (a load wrote none of them).
    unreadable: bool = False

    @property
    def failed(self) -> bool:
        return self.unreadable or bool(self.failed_block_ids)


def job_entries(block_ids: Sequence[int], group_sizes: Sequence[int],
                block_indices: Sequence[int], chunks: Sequence[tuple[bytes, int]],
                blocks_per_chunk: int, prefix: bytes, rank: int) -> list[Entry]:
    """The values of one job (see the module doc). ValueError when the lists do not fit."""
    if len(group_sizes) != len(block_indices):
        raise ValueError(f"{len(group_sizes)} group sizes, {len(block_indices)} block indices")
    entries: list[Entry] = []
    b = c = 0
    for g, (n, first) in enumerate(zip(group_sizes, block_indices, strict=True)):
        n = int(n)
        if n == 0:
            continue
        skip = int(first) % blocks_per_chunk
        blocks = [int(x) for x in block_ids[b:b + n]]
        if len(blocks) != n:
            raise ValueError(f"group {g}: {n} blocks named, {len(blocks)} given")
        for j in range(chunks_spanned(skip, n, blocks_per_chunk)):
            if c >= len(chunks):
                raise ValueError(f"group {g} needs more chunks than the job's {len(chunks)}")
            lo = max(0, j * blocks_per_chunk - skip)
            hi = min(n, (j + 1) * blocks_per_chunk - skip)
            block_hash, key_group = chunks[c]
            entries.append(Entry(key_under(prefix, block_hash, key_group, rank), g,
                                 tuple(blocks[lo:hi]), first_pos=(skip + lo) % blocks_per_chunk))
            c += 1
        b += n
    if b != len(block_ids) or c != len(chunks):
        raise ValueError(f"job names {len(block_ids)} blocks and {len(chunks)} chunks; its "
                         f"groups use {b} and {c}")
    return entries


class DirectWorker:
    """The direct-mode OffloadingWorker's logic over one rank's `KVOffloader` (owned)."""

    def __init__(self, offloader: KVOffloader, prefix: bytes, rank: int, blocks_per_chunk: int,
                 wait_timeout_s: float = 120.0) -> None:
        self.offloader, self.prefix, self.rank = offloader, prefix, rank
        self.bpc = blocks_per_chunk
        self.wait_timeout_s = wait_timeout_s
        self._ready: list[FinishedJob] = []  # decided at submit time
        self._skipped_partial = 0

    # ------------------------------------------------------------------ jobs
    def submit_store(self, job_id: int, block_ids: Sequence[int], group_sizes: Sequence[int],
                     block_indices: Sequence[int], chunks: Sequence[tuple[bytes, int]]) -> None:
        try:
            entries = job_entries(block_ids, group_sizes, block_indices, chunks, self.bpc,
                                  self.prefix, self.rank)
            # A value is only ever written whole: a chunk the job covers in part would leave
            # the rest of the value unspecified for every later reader.
            whole = [e for e in entries if len(e.block_ids) == self.bpc]
            self._skipped_partial += len(entries) - len(whole)
            self.offloader.submit_store(job_id, whole)
        except Exception:
            logger.exception("memkv direct: store job %d not started; its chunks stay "
                             "uncached", job_id)
            self.answer_unstarted(job_id, is_load=False, block_ids=block_ids)

    def submit_load(self, job_id: int, block_ids: Sequence[int], group_sizes: Sequence[int],
                    block_indices: Sequence[int], chunks: Sequence[tuple[bytes, int]]) -> None:
        try:
            entries = job_entries(block_ids, group_sizes, block_indices, chunks, self.bpc,
                                  self.prefix, self.rank)
            self.offloader.submit_load(job_id, entries)
        except Exception:
            logger.exception("memkv direct: load job %d not started", job_id)
            self.answer_unstarted(job_id, is_load=True, block_ids=block_ids)

    def answer_unstarted(self, job_id: int, *, is_load: bool,
                         block_ids: Iterable[int] | None) -> None:
        """Answer a job that could not start: it moved nothing, and all of `block_ids` failed
        (None: the job could not be read, its blocks are unknown)."""
        failed = frozenset() if block_ids is None else frozenset(int(b) for b in block_ids)
        self._ready.append(FinishedJob(job_id, is_load, failed, 0, 0.0,
                                       unreadable=block_ids is None))

    def get_finished(self) -> list[FinishedJob]:
        out, self._ready = self._ready, []
        for r in self.offloader.poll():
            # One line per job (a store's failed blocks are those not stored), also for whoever
            # needs the transfer rate itself (benchmarks/gpu_ttft.py reads it): vLLM's own
            # metrics for it differ from version to version.
            logger.debug("memkv direct: %s job %d: %d B in %.6f s, %d block(s) failed",
                         "load" if r.is_load else "store", r.job_id, r.nbytes, r.seconds,
                         len(r.failed_block_ids))
            out.append(FinishedJob(r.job_id, r.is_load, frozenset(r.failed_block_ids), r.nbytes,
                                   r.seconds))
        return out

    def prioritize(self, job_ids: Iterable[int]) -> None:
        """Move the jobs ahead of queued work without waiting for them (a load the engine will
        wait for before this step's forward pass)."""
        self.offloader.prioritize(list(job_ids))

    def wait(self, job_ids: Iterable[int]) -> None:
        ids = list(job_ids)
        self.offloader.prioritize(ids)
        if not self.offloader.wait(ids, timeout=self.wait_timeout_s):
            logger.error("memkv direct: jobs %s still touch their blocks after "
                         "memkv_wait_timeout_s=%g s; giving them up", ids, self.wait_timeout_s)
            self.offloader.abandon(ids)

    def has_pending_jobs(self) -> bool:
        return bool(self._ready) or self.offloader.has_pending_jobs()

    def shutdown(self) -> None:
        self.offloader.close()
