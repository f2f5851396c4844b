"""The name users configure for direct mode (`"spec_module_path": "memkv_vllm.spec"`).

The spec lives in `memkv_vllm.vllm.spec`; this module keeps the configured name working.
"""

from memkv_vllm.vllm.spec import MemKVOffloadingSpec

__all__ = ["MemKVOffloadingSpec"]
