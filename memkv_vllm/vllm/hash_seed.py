"""The warning both modes give when other processes will compute other block hashes.

A block's key is its vLLM block hash, so an engine shares blocks with another only if both seed
the hash chain alike (compat's `block_hashes_reproducible` knows when this vLLM does not).
"""

from __future__ import annotations

import logging

from memkv_vllm.vllm.compat import api


def warn_if_hashes_differ(logger: logging.Logger, mode: str) -> bool:
    """Log, as `memkv <mode>`, why other engines will never hit this engine's blocks, if they
    will not. Returns True if it warned (callers warn once)."""
    ok, why = api().block_hashes_reproducible()
    if not ok:
        logger.warning("memkv %s: %s; other engines will compute other block hashes and never hit "
                       "this engine's blocks (set PYTHONHASHSEED to the same value everywhere)",
                       mode, why)
    return not ok
