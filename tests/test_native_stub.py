"""memkv_vllm/_native.pyi, which mypy checks memkv_vllm against, says what the built extension
has: mypy's stubtest compares its names, signatures and defaults with the imported module, so a
method added to native/crates/memkv-py but not to the stub (or a changed default) fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# What the stub leaves out on purpose: the test peer (a class for tests, absent from builds
# without it), and so PyO3's __all__, which lists it where it is built.
ALLOWED = [r"memkv_vllm\._native\.RdmaTestPeer(\..*)?", r"memkv_vllm\._native\.__all__"]


def test_the_stub_matches_the_built_extension(tmp_path):
    pytest.importorskip("mypy.stubtest", reason="mypy is a test dependency (pyproject [test])")
    allow = tmp_path / "allowlist.txt"
    allow.write_text("\n".join(ALLOWED) + "\n")
    r = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "memkv_vllm._native",
         "--mypy-config-file", str(ROOT / "pyproject.toml"),
         "--allowlist", str(allow), "--ignore-unused-allowlist"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
