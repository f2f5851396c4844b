"""The `memkv` command: a thin shim into the native CLI (serve, stats, ping, bench)."""

import sys


def main() -> int:
    from memkv_vllm import _native

    return _native.cli_main(["memkv", *sys.argv[1:]])


if __name__ == "__main__":
    raise SystemExit(main())
