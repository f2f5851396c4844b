#!/usr/bin/env bash
# The built wheel, tested from the wheel alone: bash scripts/test-wheel.sh [WHEEL] [-- PYTEST_ARGS]
#
# For each Python of WHEEL_PYTHONS (default "3.10 3.11 3.12 3.13"), found in pyenv's versions or
# as python3.X on PATH:
#   1. a clean venv /tmp/memkv-wheel-py3.X (remade every run), with no Rust on PATH (~/.cargo/bin
#      and every folder holding cargo or rustc are dropped) and nothing from this tree on
#      PYTHONPATH;
#   2. pip install WHEEL (default: the manylinux_2_28 x86-64 wheel in dist/, from
#      scripts/build-wheels.sh) plus the test deps (pyproject's [test] extra, from PyPI);
#   3. checks that memkv_vllm is the installed one (site-packages, not this tree) and that the
#      wheel's `memkv` command runs: `memkv serve` answers `memkv ping`, `memkv bench` runs a
#      small round;
#   4. runs the vLLM-free suite: pytest tests/ from the venv's own pytest (so the tree is not on
#      sys.path); the fixtures start the venv's `memkv` (tests/memkv_procs.py: the console
#      script beside the interpreter); tests that need vLLM, torch, a GPU or the test-peer build
#      (tests/test_server_rdma.py) skip themselves.
# A summary line per Python at the end. Pythons not found are reported SKIPPED, not failed.
#
# Options: --quick  for CI's time budget: on every Python the smoke checks of step 3 and the
#                   client, server, CLI and config tests (SMOKE_TESTS below), without the slow
#                   ones (CI's scripts/test.sh ran the whole suite from the source build, and the
#                   wheel is one abi3 binary for all of them); without --quick every Python runs
#                   the whole suite;
#          anything after `--` goes to pytest.
# Env: WHEEL_PYTHONS, PIP_ARGS (extra pip install arguments, e.g. --no-index --find-links DIR).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

WHEEL="" QUICK=0
PYTEST_ARGS=()
while (($#)); do
  case "$1" in
    --quick) QUICK=1 ;;
    --) shift; PYTEST_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    -*) echo "test-wheel.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) WHEEL="$1" ;;
  esac
  shift
done
if [[ -z "$WHEEL" ]]; then
  WHEEL=$(find "$ROOT/dist" -maxdepth 1 -name 'memkv_vllm-*-manylinux_2_28_x86_64.whl' 2>/dev/null \
    | sort | tail -n1)
fi
[[ -f "$WHEEL" ]] || {
  echo "no wheel: bash scripts/build-wheels.sh first, or name one (test-wheel.sh WHEEL)" >&2
  exit 2
}
((QUICK)) && PYTEST_ARGS=(-m "not slow" "${PYTEST_ARGS[@]}")
SMOKE_TESTS=(tests/test_client.py tests/test_server.py tests/test_cli.py tests/test_config.py)
# The [test] extra of pyproject.toml: pytest and the libraries the suite imports.
TEST_DEPS=$(python3 -c 'import tomllib; print(" ".join(
  tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]))' \
  2>/dev/null || echo "pytest hypothesis matplotlib redis hiredis")
read -r -a TEST_DEPS <<<"$TEST_DEPS"

T0=$(date +%s)
declare -a SUMMARY=()
FAILED=0
log() { printf '\n==> [wheel %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }

# PATH without Rust: the wheel must need no compiler or cargo at install or run time.
NORUST_PATH=""
IFS=: read -r -a dirs <<<"$PATH"
for d in "${dirs[@]}"; do
  [[ -z "$d" || "$d" == "$HOME/.cargo/bin" || -x "$d/cargo" || -x "$d/rustc" ]] && continue
  NORUST_PATH="${NORUST_PATH:+$NORUST_PATH:}$d"
done

find_python() {  # find_python 3.X: prints a working interpreter of that version, or nothing
  local v="$1" p root
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  # pyenv's shims are on PATH even for versions not selected: try its versions first.
  for p in $(find "$root/versions" -maxdepth 3 -path "*/versions/$v.*/bin/python$v" 2>/dev/null \
      | sort -rV) "$(command -v "python$v" 2>/dev/null)"; do
    [[ -n "$p" ]] && "$p" -c 'import venv' 2>/dev/null && { echo "$p"; return 0; }
  done
  return 1
}

# Every command checked by hand: set -e does not apply inside a function called with `||`.
# shellcheck disable=SC2329  # invoked through the loop below
test_in() {  # test_in <python> <venv> <test paths...>: steps 1-4; pytest's last line is the summary
  local py="$1" venv="$2" vpy="$2/bin/python" addr="" out pid rc=0
  shift 2
  local run=(env -u PYTHONPATH PATH="$venv/bin:$NORUST_PATH")
  rm -rf "$venv"
  "$py" -m venv "$venv" || return 1
  "${run[@]}" "$vpy" -m pip install -q --upgrade pip || return 1
  # shellcheck disable=SC2086  # PIP_ARGS is a list of words
  "${run[@]}" "$vpy" -m pip install -q ${PIP_ARGS:-} "$WHEEL" "${TEST_DEPS[@]}" || return 1
  # From / so that this tree cannot be imported instead of the installed package.
  (cd / && "${run[@]}" "$vpy" -c '
import shutil, sysconfig
import memkv_vllm, memkv_vllm._native as n
site = sysconfig.get_paths()["platlib"]
assert memkv_vllm.__file__.startswith(site), f"memkv_vllm from {memkv_vllm.__file__}, not {site}"
assert not shutil.which("cargo") and not shutil.which("rustc"), "Rust is on PATH"
print("memkv_vllm from", memkv_vllm.__file__, "| extension", n.__file__, "| no Rust on PATH")
') || return 1
  echo "memkv serve, answered by memkv ping ($venv/bin/memkv, the wheel's command)"
  out=$(mktemp)
  "${run[@]}" memkv serve --listen 127.0.0.1:0 --memory 32M --lanes 2 >"$out" 2>&1 &
  pid=$!
  for _ in $(seq 300); do
    addr=$(sed -n 's/^memkv listening on //p' "$out")
    [[ -n "$addr" ]] || ! kill -0 "$pid" 2>/dev/null && break
    sleep 0.1
  done
  if [[ -n "$addr" ]]; then
    "${run[@]}" memkv ping --servers "$addr" || rc=1
  else
    echo "memkv serve did not start:"; cat "$out"; rc=1
  fi
  kill -TERM "$pid" 2>/dev/null
  wait "$pid" || rc=1
  rm -f "$out"
  ((rc == 0)) || return 1
  echo "memkv bench (one small round against a server of its own)"
  "${run[@]}" memkv bench --sizes 64K --threads 1 --volume 8M --memory 64M --repeat 1 \
    --keys 10 || return 1
  echo "pytest tests/ ($("$vpy" --version))"
  "${run[@]}" "$venv/bin/pytest" "$@" -q -ra -p no:cacheprovider "${PYTEST_ARGS[@]}"
}

log "wheel $(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1)); Pythons: ${WHEEL_PYTHONS:-3.10 3.11 3.12 3.13}"
for v in ${WHEEL_PYTHONS:-3.10 3.11 3.12 3.13}; do
  py=$(find_python "$v" || true)
  if [[ -z "$py" ]]; then
    log "Python $v: SKIPPED (no python$v on PATH or in pyenv)"
    SUMMARY+=("$(printf '%-14s SKIPPED: no interpreter' "Python $v")")
    continue
  fi
  log "Python $v ($py): clean venv, the wheel, the vLLM-free suite"
  ts=$(date +%s) rc=0
  logf=$(mktemp /tmp/memkv-wheel-py"$v".XXXXXX.log)
  selection=(tests)
  ((QUICK)) && selection=("${SMOKE_TESTS[@]}")
  echo "tests: ${selection[*]}"
  test_in "$py" "/tmp/memkv-wheel-py$v" "${selection[@]}" 2>&1 | tee "$logf" || rc=$?
  result=$(grep -E '^(=+ )?[0-9]+ (passed|failed)|no tests ran' "$logf" | tail -n1 | tr -d '=' \
    | sed 's/^ *//; s/ *$//' || true)
  if ((rc != 0)); then FAILED=1; verdict="FAIL (exit $rc)"; else verdict=PASS; fi
  SUMMARY+=("$(printf '%-14s %-14s %5ss  %s (%s)' "Python $v" "$verdict" "$(( $(date +%s) - ts ))" \
    "${result:-no pytest summary: see $logf}" "${selection[*]}")")
  ((rc != 0)) || rm -f "$logf"
done

printf '\n==> wheel test summary (%s, %ss)\n' "$(basename "$WHEEL")" "$(( $(date +%s) - T0 ))"
for line in "${SUMMARY[@]}"; do printf '    %s\n' "$line"; done
((FAILED == 0)) && echo "==> wheel: all passed" || echo "==> wheel: FAILED"
exit "$FAILED"
