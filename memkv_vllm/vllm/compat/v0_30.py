"""vLLM 0.30: sizes are counted in chunks.

`TransferJob.block_ids` became `chunk_ids` (int32!), and the spec/region sizes became
`num_chunks` / `kv_bytes_per_chunk`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memkv_vllm.vllm.compat.v0_28 import Api028


class Api030(Api028):
    name = "0.30"

    @staticmethod
    def probe() -> bool:
        if not Api028.probe():
            return False
        from vllm.v1.kv_offload.tiering import base as tb

        return "chunk_ids" in {f.name for f in dataclasses.fields(tb.TransferJob)}

    def job_slots(self, job: Any) -> list[int]:
        # int() per element: chunk_ids is int32, slot * row_stride would wrap in numpy.
        return [int(s) for s in job.chunk_ids]

    def open_worker_region(self, spec: Any, rank: int) -> Any:
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

        # The tiering spec passes no barrier: it keeps the file until shutdown.
        return SharedOffloadRegion(
            engine_id=self.engine_id(spec),
            num_chunks=spec.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
            cpu_page_size=spec.cpu_page_size_per_worker,
        )
