"""Direct-mode offloading core, without vLLM: paged KV tensors <-> one memkv value per block.

* `paged` — the geometry of a paged KV cache (`PagedKV`, `KVRef`) and of a job's values (`Entry`).
* `movers` — gather/scatter between KV tensors and scratch slots (batched CUDA copies or memmove).
* `offloader` — `KVOffloader`: jobs of entries through scratch and a `BlockStore`, failures as
  values (`JobResult.failed_block_ids` = blocks to recompute).

torch is imported only when a mover is made, so the package imports without it.
"""

from memkv_vllm.offload.offloader import JobResult, KVOffloader, MappedBatches
from memkv_vllm.offload.paged import Entry, KVRef, PagedKV

__all__ = ["Entry", "JobResult", "KVOffloader", "KVRef", "MappedBatches", "PagedKV"]
