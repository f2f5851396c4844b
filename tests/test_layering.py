"""Only memkv_vllm/compat/ may import or probe vLLM: an AST scan of the package, and the
vLLM-free modules imported with vLLM made unimportable."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

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


def test_no_module_outside_compat_imports_vllm() -> None:
    offenders = {}
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 10
    for path in files:
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "compat":
            continue
        lines = _vllm_references(ast.parse(path.read_text(), str(path)))
        if lines:
            offenders[str(rel)] = lines
    assert offenders == {}


def test_the_contract_and_store_import_without_vllm_or_torch() -> None:
    code = ("import sys; sys.modules['vllm'] = None; sys.modules['torch'] = None\n"
            "import memkv_vllm.interface, memkv_vllm.store, memkv_vllm.keys, memkv_vllm.config\n"
            "import memkv_vllm; memkv_vllm.register(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
