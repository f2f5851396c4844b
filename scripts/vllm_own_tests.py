"""Run vLLM's own offloading test suites with and without memkv-vllm registered, and compare.

    python scripts/vllm_own_tests.py --vllm-src PATH [--python VENV_PYTHON] [--out DIR]
                                     [-- extra pytest args]

PATH is a vLLM source tree at the tag of the installed vLLM (a git checkout, or the sdist
`vllm-X.Y.Z.tar.gz` from PyPI unpacked: it ships tests/). Nothing is fetched. VENV_PYTHON is the
interpreter of a vLLM venv with memkv-vllm installed (default: this one); vLLM's tests/conftest.py
also needs `tblib` in it.

The suites (those present in PATH): tests/v1/kv_offload, tests/v1/kv_connector/unit/
offloading_connector and tests/v1/kv_connector/unit/test_offloading_connector.py. Each runs twice
from PATH: once as vLLM alone (VLLM_PLUGINS set to a name no plugin has), once with
`memkv_vllm.register()` called first, which is what vLLM's plugin loader does in every process
(it registers the memkv tier and, on the CPU platform, serves TieringOffloadingSpec with
memkv-vllm's copy worker). The report lists every test whose outcome differs between the two runs
(a test memkv-vllm breaks, or one it makes pass) and the counts of each run; the exit status is 1
when a test that passed alone fails with memkv-vllm registered.

vLLM's tests exercise vLLM's own tiers and specs; the same assertions against the memkv tier are
tests/tier/test_vllm_tier_suite.py in this repository (docs/tier.md, "vLLM's own tests").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SUITES = (
    "tests/v1/kv_offload",
    "tests/v1/kv_connector/unit/offloading_connector",
    "tests/v1/kv_connector/unit/test_offloading_connector.py",
)
# Runs pytest after registering memkv-vllm, as vLLM's plugin loader would in this process.
WITH_MEMKV = ("import sys, memkv_vllm, pytest; memkv_vllm.register(); "
              "sys.exit(pytest.main(sys.argv[1:]))")


def outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed | failed | error | skipped, from a JUnit XML report."""
    out: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[name] = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
        out[name] = {"failure": "failed"}.get(out[name], out[name])
    return out


def run(python: str, src: Path, junit: Path, suites: list[str], with_memkv: bool,
        extra: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    if with_memkv:
        cmd = [python, "-c", WITH_MEMKV]
        env.pop("VLLM_PLUGINS", None)
    else:
        cmd = [python, "-m", "pytest"]
        env["VLLM_PLUGINS"] = "none-but-vllm"  # no installed plugin has this name
    cmd += [*suites, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *extra]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=src, env=env, check=False)
    return outcomes(junit)


def counts(res: dict[str, str]) -> str:
    kinds = ("passed", "failed", "error", "skipped")
    return ", ".join(f"{sum(v == k for v in res.values())} {k}" for k in kinds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-src", type=Path, required=True)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--out", type=Path, default=Path("vllm-own-tests"))
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args()

    src = args.vllm_src.resolve()
    suites = [s for s in SUITES if (src / s).exists()]
    if not suites:
        print(f"no vLLM offloading tests under {src}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    alone = run(args.python, src, out / "vllm-alone.xml", suites, False, args.pytest_args)
    memkv = run(args.python, src, out / "with-memkv.xml", suites, True, args.pytest_args)

    print(f"\nvLLM alone:          {counts(alone)}")
    print(f"memkv-vllm registered: {counts(memkv)}")
    changed = sorted(t for t in alone.keys() | memkv.keys() if alone.get(t) != memkv.get(t))
    for t in changed:
        print(f"  {alone.get(t, 'absent'):>8} -> {memkv.get(t, 'absent'):<8} {t}")
    if not changed:
        print("no test changes outcome with memkv-vllm registered")
    broken = [t for t in changed if alone.get(t) == "passed"]
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
