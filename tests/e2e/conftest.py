"""Fixtures of the real-vLLM end-to-end tests (process helpers: vllm_procs.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model scripts/setup-vllm.sh makes ($TINY_MODEL), built here if missing."""
    path = Path(os.environ.get("TINY_MODEL", ROOT / ".cache" / "tinymodel"))
    if not (path / "config.json").exists():
        path = tmp_path_factory.mktemp("tinymodel")
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), str(path)],
                       check=True, capture_output=True)
    return str(path)
