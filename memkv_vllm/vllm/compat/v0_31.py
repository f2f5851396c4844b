"""vLLM 0.31 and later (tested up to 0.33, whose changes here need no adapter): back-pressure.

The tier factory always passes `backpressure_detector=` to the tier constructor and the base class
must receive it (the manager reads `tier.bp_detector`); `JobResult` gained `transfer_bytes`, which
feeds that detector. 0.31 also stopped calling `touch()`, which this tier does not rely on.
0.33 adds `submit_load(..., expedited=)` (the base class's worker accepts it), a manager lock, a
tier-poll thread for tiers that opt in, and moves `on_schedule_end()` after the stores of a step;
none of it changes what this adapter translates.
"""

from __future__ import annotations

import inspect
from typing import Any

from memkv_vllm.vllm.compat.v0_30 import Api030


class Api031(Api030):
    name = "0.31"
    result_has_transfer_bytes = True

    @staticmethod
    def probe() -> bool:
        if not Api030.probe():
            return False
        from vllm.v1.kv_offload.tiering import base as tb

        params = inspect.signature(tb.SecondaryTierManager.__init__).parameters
        return "backpressure_detector" in params

    def tier_base_kwargs(self, tier_kwargs: dict[str, Any]) -> dict[str, Any]:
        # The base class keeps it as `bp_detector`, which the manager consults before cascading.
        return {"backpressure_detector": tier_kwargs.pop("backpressure_detector", None)}

