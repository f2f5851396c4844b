"""Direct-mode tests below the vLLM shell: real memkv servers, host KV tensors, no vLLM."""

from __future__ import annotations

import pytest

pytest.importorskip("memkv_vllm._native", reason="needs the built memkv client")
