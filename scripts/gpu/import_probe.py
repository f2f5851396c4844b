#!/usr/bin/env python3
"""Import vLLM's engine-path modules with the CUDA platform forced, to find missing dependencies.

  python scripts/gpu/import_probe.py [MODULE ...]

Prints OK or the first error per module; exits 1 if any failed. On a machine without a GPU it
answers the device queries modules make at import time as an H200 would, and needs a stub
libcuda.so.1 on LD_LIBRARY_PATH (stub_libcuda.c beside this file:
`gcc -shared -fPIC -o libcuda.so.1 stub_libcuda.c`). That is how scripts/gpu/carry-deps.txt was
found: each missing module's distribution was installed until every module imported. On the GPU
host (scripts/gpu-run.sh python scripts/gpu/import_probe.py) it checks the bundle.
"""

from __future__ import annotations

import importlib
import sys
import traceback

import torch
import vllm.platforms
from vllm.platforms.cuda import CudaPlatform

MODULES = """
vllm.entrypoints.llm vllm.v1.engine.core vllm.v1.engine.llm_engine vllm.v1.engine.core_client
vllm.v1.executor.multiproc_executor vllm.v1.executor.uniproc_executor vllm.v1.worker.gpu_worker
vllm.v1.worker.gpu_model_runner vllm.model_executor.models.llama
vllm.v1.attention.backends.triton_attn vllm.v1.sample.sampler vllm.v1.kv_offload.cpu.spec
vllm.v1.kv_offload.cpu.gpu_worker vllm.v1.kv_offload.tiering.spec
vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector
vllm.distributed.kv_transfer.kv_connector.factory vllm.model_executor.model_loader.default_loader
vllm.v1.structured_output vllm.tokenizers vllm.renderers vllm.entrypoints.openai.api_server
memkv_vllm memkv_vllm.spec memkv_vllm.tier memkv_vllm.connector
""".split()


def main() -> int:
    if not torch.cuda.is_available():
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 1
        torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
    vllm.platforms.current_platform = CudaPlatform()
    bad = 0
    for name in sys.argv[1:] or MODULES:
        try:
            importlib.import_module(name)
            print("OK  ", name)
        except BaseException as e:  # a missing .so raises OSError, a probe must go on
            bad += 1
            where = traceback.extract_tb(e.__traceback__)[-1]
            print("FAIL", name, type(e).__name__, e, f"(at {where.filename}:{where.lineno})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
