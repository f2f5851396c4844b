"""vLLM 0.28-0.29: tier jobs are `TransferJob`s and results can be partial.

`JobMetadata` became `TransferJob` (a different `JobMetadata` NamedTuple now lives in
tiering/manager.py), `JobResult` gained `successful_keys` and `transfer_time`, and the shared
region hands out per-worker views with `create_next_worker_view`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

from memkv_vllm.vllm.compat.v0_26 import Api026


class Api028(Api026):
    name = "0.28"

    @staticmethod
    def probe() -> bool:
        if not Api026.probe():
            return False
        from vllm.v1.kv_offload.tiering import base as tb

        return hasattr(tb, "TransferJob") and "successful_keys" in {
            f.name for f in dataclasses.fields(tb.JobResult)
        }

    # JobResult.transfer_bytes exists from 0.31 on (it feeds the back-pressure detector).
    result_has_transfer_bytes = False

    def job_result(self, job_id: int, success: bool, *,
                   successful_keys: Collection[bytes] | None = None,
                   transfer_time: float | None = None,
                   transfer_bytes: int | None = None) -> Any:
        fields: dict[str, Any] = {
            "job_id": job_id, "success": success,
            # None unless some keys transferred and some did not: vLLM reads None as "every key
            # shares the job's fate", and its own tiers never report an empty collection.
            "successful_keys": None if success or not successful_keys else successful_keys,
            "transfer_time": transfer_time,
        }
        if self.result_has_transfer_bytes:
            fields["transfer_bytes"] = transfer_bytes
        return self.tb.JobResult(**fields)

    def region_worker_view(self, region: Any, nbytes: int) -> Any:
        return region.create_next_worker_view(nbytes)
