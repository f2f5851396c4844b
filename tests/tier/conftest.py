"""Tier tests need vLLM: they run in the venvs of scripts/setup-vllm.sh and are not collected
elsewhere (the harness and its fixtures live in harness.py)."""

import importlib.util

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    from harness import _vllm_ready, engines, proxy  # noqa: F401  (fixtures)
