"""One "node" of a multi-node engine for the prefix-board tests, as a process of its own.

    python tests/board_node.py '<json>'

The JSON names the cluster (`config`: memkv_vllm.core.config settings), the `engine` id, this
node's board directory (`root`), the worker ranks it holds (`publish`: rank -> prefix hex) and,
for the scheduler's node, the world size to `adopt` (with `wait_s`, `since`). It prints one JSON
line once it has published ({"host", "pid"}), then, when adopting, {"adopted": hex} or
{"error": message} with the "seconds" adopting took; with `hold` it stays alive (its entries
stay live) until stdin closes.
Run it under `unshare --uts` with another host name to make it another host.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from memkv_vllm.core.backends import make_client
from memkv_vllm.core.config import load_config
from memkv_vllm.direct.prefixes import PrefixBoard, PrefixMismatch


def main() -> None:
    spec = json.loads(sys.argv[1])
    client = make_client(load_config(spec["config"], env={}))
    board = PrefixBoard(spec["engine"], client, Path(spec["root"]),
                        wait_s=spec.get("wait_s", 10.0), since=spec.get("since"))
    for rank, prefix in spec.get("publish", {}).items():
        board.publish(int(rank), bytes.fromhex(prefix))
    print(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}), flush=True)
    if spec.get("adopt"):
        t0 = time.monotonic()
        try:
            out = {"adopted": board.adopt(spec["adopt"]).hex()}
        except PrefixMismatch as e:
            out = {"error": str(e)}
        print(json.dumps({**out, "seconds": time.monotonic() - t0}), flush=True)
    if spec.get("hold"):
        sys.stdin.read()
    client.close()


if __name__ == "__main__":
    main()
