"""The engine-free core: no serving stack is imported here.

* `interface` — the written contract between engine adapters and the store (Protocols, statuses).
* `store` — `BlockStore`, the `Offloader` over one client: lookups, batched loads and stores.
* `client` — `MemKVClient`, the native memkv client (placement over servers, pools, transports).
* `completions` — completion queues and submitted calls for clients whose I/O runs in Python
  threads (the Redis backend, a blocking-only `BlockClient` under the store).
* `redis_client` — the same client contract over a Redis/Valkey Cluster (`backend: redis`).
* `backends` — picks the client for the configured backend, and builds the store over it.
* `request_lookups` — a scheduler step's lookups by request (preempted ones are not probed).
* `config` — connection settings from MEMKV_CONFIG / MEMKV_* and their checks.
* `keys` — the tier's key layout (model, layout, rank and tenant never collide).

Data flows one way: engine adapter -> interface -> client -> transport -> server.
"""
