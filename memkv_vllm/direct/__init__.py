"""Direct mode without vLLM: what `memkv_vllm.spec` (the vLLM-facing shell) delegates to.

* `options` — the `memkv_*` keys of kv_connector_extra_config, parsed and checked at startup.
* `namespace` — the key layout a worker derives from its model, weights and KV geometry.
* `prefixes` — workers publish their key prefix at startup, the scheduler adopts it.
* `cluster` — the client and block store of the scheduler's process.
* `nic`, `scratch`, `rank_io` — a worker rank's NIC, where its scratch slots live, and its client
  and block store set up on them.
* `manager` — scheduler side: lookups (with server leases), loads and stores by chunk key.
* `worker` — worker side: jobs over the engine's KV tensors through `KVOffloader`, answered as
  plain values.
* `load_failures` — what a failed load is reported as: a failure, or blocks to recompute.

No vLLM imports here: the spec converts vLLM's objects to plain values (compat does the
version-specific part) and back.
"""
