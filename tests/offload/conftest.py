"""Offloader tests need torch (the vLLM venvs have it) and the built memkv client."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("memkv_vllm._native", reason="needs the built memkv client")
