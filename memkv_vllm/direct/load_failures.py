"""`LoadFailurePolicy`: what a direct-mode job that failed becomes for the serving stack.

One decision, taken here only:

* a store that failed is answered as done: its values are simply not in the cluster, which costs
  a later miss (the manager's lookups never claim a value the cluster does not answer for);
* a load that did not write all of its blocks is reported FAILED by default. vLLM's stock
  OffloadingConnector has no way to recompute blocks and stops the engine on a failed transfer,
  which is right: generating from KV that was never loaded would serve wrong tokens, and a failed
  transfer must never be reported as a success;
* once a connector that has vLLM recompute such blocks switched the policy to recompute
  (`recompute_failed_loads`, memkv_vllm.vllm.connector), the load is answered as done and its
  unwritten blocks are handed to that connector (`take_load_errors`), which passes them to vLLM's
  scheduler as blocks with load errors. A load whose blocks are unknown (its job could not be
  read) can be recomputed by no one: it is reported failed either way.

Implements `memkv_vllm.core.interface.LoadErrorReporter`. Threads: vLLM's worker thread (the one
that collects the worker's jobs). No vLLM imports.
"""

from __future__ import annotations

import logging

from memkv_vllm.direct.worker import FinishedJob

logger = logging.getLogger("vllm.memkv_direct")


class LoadFailurePolicy:
    """Decides each finished job's success (see the module doc); keeps the blocks to recompute."""

    def __init__(self) -> None:
        self._recompute = False
        self._errors: set[int] = set()

    def recompute_failed_loads(self) -> None:
        self._recompute = True

    def success(self, job: FinishedJob) -> bool:
        """What the job is reported as. Never raises."""
        if not job.is_load or not job.failed:
            return True
        if self._recompute and not job.unreadable:
            logger.warning("memkv direct: load job %d failed for %d block(s); vLLM's "
                           "kv_load_failure_policy applies to them", job.job_id,
                           len(job.failed_block_ids))
            self._errors |= job.failed_block_ids
            return True
        what = ("could not be read" if job.unreadable
                else f"failed for {len(job.failed_block_ids)} block(s)")
        how = ("no connector can recompute blocks it cannot name" if self._recompute
               else "vLLM's OffloadingConnector has no way to recompute them; select "
               "MemKVOffloadingConnector in --kv-transfer-config to recompute instead")
        logger.error("memkv direct: load job %d %s and %s. Reporting the failed transfer: vLLM "
                     "stops the engine rather than generate from KV that was never loaded.",
                     job.job_id, what, how)
        return False

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors
