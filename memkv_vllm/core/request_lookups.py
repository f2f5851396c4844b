"""`RequestLookups`: an `Offloader`'s lookups of one scheduler step, remembered by request.

A scheduler asks for keys request by request and ends each step once. At the end of the step the
keys still waiting for a probe go out as one batch, except those only preempted requests asked
for: a preempted request starts over, and probing for it now is wasted work unless a request that
still runs asked for the same key. The vLLM tier and direct mode's manager both end their steps
through this.

Threads: the store's owner thread only (the scheduler thread). No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Iterable

from memkv_vllm.core.interface import Lookup, Offloader


class RequestLookups:
    """Lookups through `store`, with the keys each request is waiting for in this step."""

    def __init__(self, store: Offloader) -> None:
        self.store = store
        self._asked: dict[str, list[bytes]] = {}  # request id -> keys queued for this step

    def lookup(self, key: bytes, req_id: str) -> Lookup:
        """`store.lookup(key)`; a PENDING key is remembered as asked for by `req_id`."""
        verdict = self.store.lookup(key)
        if verdict is Lookup.PENDING:
            self._asked.setdefault(req_id, []).append(key)
        return verdict

    def end_step(self, preempted_req_ids: Iterable[str] = ()) -> None:
        """Cancel what only preempted requests asked for, then send this step's probe."""
        asked, self._asked = self._asked, {}
        preempted = set(preempted_req_ids) & set(asked)
        if preempted:
            keep = {k for rid, ks in asked.items() if rid not in preempted for k in ks}
            self.store.cancel_lookups([k for rid in preempted for k in asked[rid]
                                       if k not in keep])
        self.store.flush_lookups()

    def clear(self) -> None:
        """Forget who asked (the keys stay queued in the store for the next flush)."""
        self._asked.clear()
