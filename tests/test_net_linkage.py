"""The wheel's extension must import on any Linux host: it may load libfabric at run time
(dlopen) but must not name it, or anything RDMA, among the libraries the dynamic loader resolves.
(native/crates/memkv-cli/tests/links_no_fabric.rs checks the standalone `memkv` binary.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

from memkv_vllm import _native

FABRIC = ("libfabric", "libibverbs", "librdmacm", "libefa", "libmlx5", "libucp", "libucs")


def test_the_extension_links_no_fabric_library() -> None:
    ext = Path(_native.__file__)
    assert ext.suffix == ".so" and ext.name.startswith("_native")
    # NEEDED entries name what the extension links; ldd also shows what those pull in.
    needed = subprocess.run(["readelf", "-d", str(ext)], capture_output=True, text=True,
                            check=True).stdout
    resolved = subprocess.run(["ldd", str(ext)], capture_output=True, text=True,
                              check=True).stdout
    assert "(NEEDED)" in needed and "libc.so.6" in needed, needed
    for lib in FABRIC:
        assert lib not in needed, f"{ext} links {lib}:\n{needed}"
        assert lib not in resolved, f"{ext} loads {lib}:\n{resolved}"
