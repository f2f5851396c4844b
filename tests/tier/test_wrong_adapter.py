"""Each compat adapter is needed: with any other generation's adapter forced on the installed
vLLM, the tier tests fail (test_shm_pool.py tells 0.25's adapter from 0.26's: only a real spec
shows how a generation names the engine and the pool region). Run in every vLLM venv; each run
forces the adapters that do not match it, in a fresh process, since one process uses one
adapter."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from memkv_vllm.vllm import compat

HERE = pathlib.Path(__file__).parent

pytestmark = pytest.mark.skipif(bool(os.environ.get("MEMKV_TEST_ADAPTER")),
                                reason="already running under a forced adapter")


@pytest.mark.parametrize("generation", [g.name for g in compat.generations()])
def test_a_wrong_adapter_fails_the_tier_tests(generation: str) -> None:
    right = compat.detect().name
    if generation == right:
        pytest.skip(f"{generation} is this vLLM's adapter")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
         str(HERE / "test_compat.py"), str(HERE / "test_tier.py"),
         str(HERE / "test_shm_pool.py")],
        env={**os.environ, "MEMKV_TEST_ADAPTER": generation}, cwd=HERE.parents[1],
        capture_output=True, text=True, timeout=600,
    )
    # 1 = tests ran and some failed (not 2-5: interrupted, internal or usage error, none ran).
    assert out.returncode == 1, (
        f"the {generation} adapter on vLLM {right}: pytest rc {out.returncode}\n"
        f"{out.stdout[-3000:]}{out.stderr[-2000:]}")
    assert " failed" in out.stdout.splitlines()[-1]
