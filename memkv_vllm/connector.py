"""The name users configure for the recompute route
(`"kv_connector_module_path": "memkv_vllm.connector"`).

The connector lives in `memkv_vllm.vllm.connector`; vLLM resolves the class with
`getattr(module, "MemKVOffloadingConnector")`, which builds it there on first use.
"""

from typing import Any

from memkv_vllm.vllm import connector as _connector


def __getattr__(name: str) -> Any:
    return getattr(_connector, name)
