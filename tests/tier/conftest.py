"""Tier tests need vLLM: they run in the venvs of scripts/setup-vllm.sh and are not collected
elsewhere (the harness and its fixtures live in harness.py).

MEMKV_TEST_ADAPTER=<generation> (e.g. "0.28") forces that compat adapter instead of the detected
one; test_wrong_adapter.py uses it to show that the suite notices a wrong generation.
"""

import importlib.util
import os

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    from memkv_vllm.vllm import compat

    _forced = os.environ.get("MEMKV_TEST_ADAPTER")
    if _forced:
        compat.use(next(c for c in compat.generations() if c.name == _forced))

    from harness import _vllm_ready, engines, proxy  # noqa: F401  (fixtures)
