"""The vLLM-facing wing: the only package that imports vLLM.

* `compat` — one small adapter per vLLM API generation, chosen by feature detection; nothing
  outside it names vLLM's internals.
* `tier` — the `memkv` secondary tier behind vLLM's CPU pool (tier mode).
* `spec` — `MemKVOffloadingSpec` (direct mode), a thin shell over `memkv_vllm.direct`.
* `connector` — `MemKVOffloadingConnector`, the recompute route for failed loads.
* `scheduler_side` — what the tier and direct mode's manager do alike on the scheduler.
* `cpu_worker`, `shm_region` — vLLM's CPU pool on the CPU platform, and its /dev/shm lifetime.
* `tiering_spec` — `MemKVTieringOffloadingSpec`, the tier mode's opt-in spec: vLLM's
  TieringOffloadingSpec with those two.
* `metrics` — the metric table both modes export, and its deltas.

Users name `memkv_vllm.spec` and `memkv_vllm.connector` in their configs: those modules
re-export what is here.
"""
