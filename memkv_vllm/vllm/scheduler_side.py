"""What both memkv managers on vLLM's scheduler do alike: the tier (tier.py) and direct mode's
offloading manager (spec.py).

* `end_step` is their `on_schedule_end`: the step's lookups go out as one probe, minus what only
  preempted requests asked for (memkv_vllm.core.request_lookups), and a failure there costs
  misses, never the scheduler.
* `warn_if_block_hashes_differ` says once that this process's block hashes will not match other
  processes', so that no engine ever hits another's blocks.

Threads: the scheduler thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

from memkv_vllm.vllm.compat import api


def end_step(step: Callable[[Collection[str]], None], context: Any, log: logging.Logger,
             who: str) -> None:
    """`step(preempted request ids)` for vLLM's ScheduleEndContext `context` (None: no
    preemption known). Never raises."""
    try:
        step(api().preempted_request_ids(context))
    except Exception:
        log.exception("memkv %s: flushing lookups failed", who)


def warn_if_block_hashes_differ(log: logging.Logger, who: str) -> bool:
    """Warn if another process will compute other block hashes; True if it warned."""
    ok, why = api().block_hashes_reproducible()
    if not ok:
        log.warning("memkv %s: %s; other processes will compute other block hashes and never hit "
                    "this engine's blocks (set PYTHONHASHSEED to the same value everywhere)",
                    who, why)
    return not ok
