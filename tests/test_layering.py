"""The package's layers, by scans of its source: only memkv_vllm/vllm/compat/ imports or probes
vLLM, reads vLLM's renamed or private attributes and names vLLM versions; only memkv_vllm/sglang/
imports SGLang, and it builds on core/ alone; core/ imports nothing above it nor any serving
stack; no import cycle; and the vLLM-free modules import with vLLM unimportable."""

from __future__ import annotations

import ast
import io
import pathlib
import re
import subprocess
import sys
import tokenize
from collections.abc import Callable

import memkv_vllm

PACKAGE = pathlib.Path(memkv_vllm.__file__).parent


def _vllm_references(tree: ast.AST) -> list[int]:
    """Lines that import vLLM or look a vLLM module up by name (importlib, find_spec)."""
    return _stack_references(tree, "vllm")


def _stack_references(tree: ast.AST, stack: str) -> list[int]:
    """Lines that import the package `stack` or look one of its modules up by name."""
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
        if any(n == stack or n.startswith(stack + ".") for n in names):
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


# ---------------------------------------------------------------------------- private attributes
# vLLM's private attributes (`region._creator`, `spec._scheduler_mmap`, ...) change without notice;
# compat/ reads them, behind adapter methods whose tests fail loudly when they move. Outside
# compat, a module may name a private attribute only if it is one of its own: bound in the module
# (a def, a class, an import, a variable) or assigned on `self`/`cls` there. Anything else is a
# private attribute of an object from elsewhere, vLLM's objects among them. A cheap rule: a
# module that assigns `self._x` itself may still read another object's `_x`.
_ACCESSORS = ("getattr", "setattr", "hasattr", "delattr")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _on_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _named_attribute(node: ast.AST) -> str | None:
    """The attribute `node` reads or writes: `x.name`, or getattr & co. with a literal name."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in _ACCESSORS and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        return node.args[1].value
    return None


def _own_names(tree: ast.AST) -> set[str]:
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.alias):
            own.add(node.asname or node.name.split(".")[-1])
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and _on_self(node.value)):
            own.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "setattr" and node.args and _on_self(node.args[0])):
            own.add(str(_named_attribute(node)))
    return own


def _foreign_private_attributes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every private attribute named in `tree` that is not the module's own."""
    own = _own_names(tree)
    found = []
    for node in ast.walk(tree):
        name = _named_attribute(node)
        if name is not None and _is_private(name) and name not in own:
            found.append((node.lineno, name))
    return sorted(found)


def test_the_private_attribute_scan_tells_foreign_names_from_own_ones() -> None:
    code = ("class Spec(Base):\n"
            "    def __init__(self):\n"
            "        self._worker = None\n"  # 3: own
            "    def get_manager(self):\n"
            "        region = self._scheduler_mmap\n"  # 5: inherited from vLLM's class
            "        region._creator = False\n"  # 6: written on vLLM's object
            "        if getattr(region, '_creator', True):\n"  # 7: read by name
            "            return self._worker, type(region).__name__\n"  # 8: own, dunder
            "def _helper(w):\n"
            "    hasattr(w._store_handler, '_mmap_region')\n"  # 10: two of vLLM's
            "    return _helper, sys._getframe\n")  # 11: own function; the stdlib's private
    assert _foreign_private_attributes(ast.parse(code)) == [
        (5, "_scheduler_mmap"), (6, "_creator"), (7, "_creator"), (10, "_mmap_region"),
        (10, "_store_handler"), (11, "_getframe")]


def test_no_module_outside_compat_names_a_foreign_private_attribute() -> None:
    assert _outside_compat(_foreign_private_attributes) == {}


# ---------------------------------------------------------------------------- vLLM versions
# Which vLLM changed what is compat's knowledge; a version named elsewhere (a comment "0.26+", a
# message "vLLM 0.33: ...") goes stale when compat changes, and is a branch on a version in
# disguise. Comments and strings only: numbers in code are not versions (plots.py's bar widths).
_VERSION = re.compile(r"(?<![\w.])(?:0\.(?:2[5-9]|3\d)(?!\d)|v0_\d\d)")
_TEXT_TOKENS = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)}


def _vllm_versions(source: str) -> list[tuple[int, str]]:
    """(line, version) of every vLLM version named in the comments and strings of `source`."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in _TEXT_TOKENS:
            found += [(tok.start[0], v) for v in _VERSION.findall(tok.string)]
    return found


def test_the_version_scan_reads_comments_and_strings_only() -> None:
    code = ("width = 0.27  # not a version\n"
            "# events need vLLM 0.26+\n"
            "log('needs 0.25.0 or newer, see v0_28.py', color='0.45')\n"
            "x = 0.30\n")
    assert _vllm_versions(code) == [(2, "0.26"), (3, "0.25"), (3, "v0_28")]


def test_no_module_outside_compat_names_a_vllm_version() -> None:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[:2] != ("vllm", "compat"):
            hits = _vllm_versions(path.read_text())
            if hits:
                found[str(rel)] = hits
    assert found == {}


# ---------------------------------------------------------------------------- import graph
SERVING_STACKS = ("vllm", "sglang", "tensorrt_llm", "lmdeploy", "text_generation_server")


def _module_name(path: pathlib.Path) -> str:
    parts = ["memkv_vllm", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(node: ast.AST, importer: str, is_package: bool) -> list[str]:
    """The modules an import statement names (absolute), `from p import m` naming p.m where p.m
    is a module of the package."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = importer.split(".")[:len(importer.split(".")) - node.level + is_package]
        base = ".".join([*anchor, *([base] if base else [])])
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    return subs or [base]


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements that run when the module is imported: not function bodies, not
    `if TYPE_CHECKING:` blocks."""
    out = []
    for stmt in body:
        out.append(stmt)
        if isinstance(stmt, ast.If):
            if not (isinstance(stmt.test, ast.Name) and stmt.test.id == "TYPE_CHECKING"):
                out += _top_level(stmt.body)
            out += _top_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            out += _top_level(stmt.body + stmt.orelse + stmt.finalbody)
            for h in stmt.handlers:
                out += _top_level(h.body)
        elif isinstance(stmt, (ast.With, ast.ClassDef)):
            out += _top_level(stmt.body)
    return out


def _edges(name: str, tree: ast.Module, *, module_level: bool) -> set[str]:
    """The memkv_vllm modules `name` imports (at import time, or anywhere), with the packages
    they sit in, but not `name`'s own packages (always imported before it)."""
    is_package = MODULES[name].name == "__init__.py"
    stmts = _top_level(tree.body) if module_level else list(ast.walk(tree))
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    out = set()
    for stmt in stmts:
        for target in _imported(stmt, name, is_package):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                mod = ".".join(parts[:i])
                if mod in MODULES and mod not in ancestors and mod != name:
                    out.add(mod)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph` (module -> modules it imports), one per strongly connected
    component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_cycles_and_only_those() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_memkv_vllm_modules() -> None:
    graph = {name: _edges(name, ast.parse(path.read_text()), module_level=True)
             for name, path in MODULES.items()}
    assert "memkv_vllm.core.backends" in graph["memkv_vllm.vllm.tier"]  # the graph sees imports
    assert _cycles(graph) == []


def test_core_imports_nothing_above_it_nor_any_serving_stack() -> None:
    # One way: the vLLM wing, direct/ and offload/ build on core/, never the reverse, and core/
    # stays usable by a backend for another serving stack. Imports anywhere, not only top level.
    found = {}
    for name, path in MODULES.items():
        if not name.startswith("memkv_vllm.core"):
            continue
        tree = ast.parse(path.read_text())
        above = sorted(m for m in _edges(name, tree, module_level=False)
                       if not m.startswith("memkv_vllm.core") and m != "memkv_vllm._native")
        stacks = sorted({n for node in ast.walk(tree)
                         for n in _imported(node, name, path.name == "__init__.py")
                         if n.split(".")[0] in SERVING_STACKS})
        if above or stacks:
            found[name] = above + stacks
    assert found == {}


# ---------------------------------------------------------------------------- SGLang
def test_the_scan_sees_every_way_of_naming_sglang() -> None:
    code = ("import sglang\nfrom sglang.srt.mem_cache import x\n"
            "importlib.import_module('sglang.srt')\nimport sglang_router\n")
    assert _stack_references(ast.parse(code), "sglang") == [1, 2, 3]


def test_only_the_sglang_package_imports_sglang() -> None:
    found = {}
    for name, path in MODULES.items():
        if not name.startswith("memkv_vllm.sglang"):
            hits = _stack_references(ast.parse(path.read_text()), "sglang")
            if hits:
                found[name] = hits
    assert found == {}


def test_the_sglang_package_builds_on_core_alone() -> None:
    # Another serving stack's backend sits beside the vLLM wing, on the same contract: it uses
    # core/ (the block store, keys, settings) and neither vLLM nor the vLLM wing's modules.
    found = {}
    sglang_modules = [n for n in MODULES if n.startswith("memkv_vllm.sglang")]
    assert "memkv_vllm.sglang.storage" in sglang_modules
    for name in sglang_modules:
        tree = ast.parse(MODULES[name].read_text())
        outside = sorted(m for m in _edges(name, tree, module_level=False)
                         if not m.startswith(("memkv_vllm.core", "memkv_vllm.sglang")))
        if outside or _vllm_references(tree):
            found[name] = outside + [f"vllm at line {n}" for n in _vllm_references(tree)]
    assert found == {}


def test_the_sglang_packages_units_import_without_sglang_or_torch() -> None:
    code = ("import sys; sys.modules['sglang'] = None; sys.modules['torch'] = None\n"
            "import memkv_vllm.sglang.pages, memkv_vllm.sglang.keys, memkv_vllm.sglang.blocking\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
