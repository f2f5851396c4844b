"""Only memkv_vllm/vllm/compat/ may import or probe vLLM: an AST scan of the package, and the
vLLM-free modules imported with vLLM made unimportable."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from collections.abc import Callable

import memkv_vllm

PACKAGE = pathlib.Path(memkv_vllm.__file__).parent


def _vllm_references(tree: ast.AST) -> list[int]:
    """Lines that import vLLM or look a vLLM module up by name (importlib, find_spec)."""
    lines = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname in ("import_module", "find_spec", "__import__") and isinstance(
                    node.args[0].value, str):
                names = [node.args[0].value]
        if any(n == "vllm" or n.startswith("vllm.") for n in names):
            lines.append(node.lineno)
    return lines


def test_the_scan_sees_every_way_of_naming_vllm() -> None:
    code = ("import vllm\nfrom vllm.v1 import x\ndef f():\n    import vllm.config as c\n"
            "importlib.import_module('vllm.platforms')\nfrom .vllm import y\n"
            "logging.getLogger('vllm.memkv')\nutil.find_spec('vllm')\n")
    assert _vllm_references(ast.parse(code)) == [1, 2, 4, 5, 8]


def _outside_compat(find: Callable[[ast.AST], list]) -> dict[str, list]:
    """{module outside compat/: what `find` reports in it}, for the modules where it reports any."""
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 10
    found = {}
    for path in files:
        rel = path.relative_to(PACKAGE)
        if rel.parts[:2] != ("vllm", "compat"):
            hits = find(ast.parse(path.read_text(), str(path)))
            if hits:
                found[str(rel)] = hits
    return found


def test_no_module_outside_compat_imports_vllm() -> None:
    assert _outside_compat(_vllm_references) == {}


def test_the_contract_and_store_import_without_vllm_or_torch() -> None:
    code = ("import sys; sys.modules['vllm'] = None; sys.modules['torch'] = None\n"
            "import memkv_vllm.core.interface, memkv_vllm.core.store, memkv_vllm.core.keys\n"
            "import memkv_vllm.core.config\n"
            "import memkv_vllm; memkv_vllm.register(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


# Attribute names of vLLM's objects that compat/ reads for everything else: those vLLM renamed
# between generations (block_size_factor, chunk_ids, ...) and those of its connector's and
# worker's internals. A cheap name check: it catches these names, not every vLLM attribute
# (generic ones such as job_id, keys or block_ids are also memkv_vllm's own).
VLLM_ATTRIBUTES = {
    "invalid_block_ids", "connector_worker", "connector_scheduler", "block_size_factor",
    "chunk_ids", "group_data_refs", "page_size_bytes", "tensor_idx", "group_sizes",
    "block_indices", "kv_cache_groups", "kv_transfer_config", "kv_load_failure_policy",
    "transfer_size", "transfer_time", "successful_keys", "is_promotion", "preempted_req_ids",
    "kv_events_config", "replicated_layout", "canonical_layout",
}


def _vllm_attributes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every use of a VLLM_ATTRIBUTES name: `x.name`, or a getattr / setattr /
    hasattr with the name as a string."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in VLLM_ATTRIBUTES:
            found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in VLLM_ATTRIBUTES):
            found.append((node.lineno, node.args[1].value))
    return sorted(found)


def test_the_attribute_scan_sees_reads_writes_and_getattr() -> None:
    code = ("a = out.invalid_block_ids\nconn.connector_worker.worker = g\n"
            "getattr(o, 'invalid_block_ids', None)\nhasattr(c, 'chunk_ids')\nx.job_id\n")
    assert _vllm_attributes(ast.parse(code)) == [
        (1, "invalid_block_ids"), (2, "connector_worker"), (3, "invalid_block_ids"),
        (4, "chunk_ids")]


def test_no_module_outside_compat_reads_vllms_renamed_or_internal_attributes() -> None:
    assert _outside_compat(_vllm_attributes) == {}
