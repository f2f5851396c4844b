#!/usr/bin/env bash
# The test suite, as one command: bash scripts/test.sh
#
#   1. makes .venv (Python deps for building and testing) if missing or out of date, and installs
#      redis-server and valkey-server with apt-get when missing (the Redis backend tests start
#      a Redis Cluster and a Valkey Cluster),
#      libfabric from apt where it is missing (scripts/setup-libfabric.sh),
#   2. runs the Rust tests (cargo test --workspace --release in native/),
#   3. builds the extension and installs memkv-vllm into .venv (maturin develop --release), with
#      memkv-py's test-peer feature (`_native.RdmaTestPeer`, which tests/test_server_rdma.py
#      sends hostile RDMA requests through; a wheel leaves it out),
#   4. runs pytest on tests/ in .venv (fixtures start real `memkv` servers on free loopback ports;
#      nothing is started by hand; tests that need vLLM skip themselves there),
#   5. for each vLLM venv made by scripts/setup-vllm.sh (.venv-vllm, .venv-vllm-0.25) that exists:
#      installs memkv-vllm into it and runs tests/tier, tests/e2e (real vLLM), the torch
#      round trips (tests/test_client_torch.py), the offloader core (tests/offload) and direct
#      mode (tests/direct: its worker and spec tests need torch and vLLM) there; in the older
#      venvs without the e2e tests of memkv's own behaviour behind an engine (marked
#      `memkv_side`: faults, the disk tier, the Redis backend), which the newest one runs,
#   6. in .venv-sglang (scripts/setup-sglang.sh) when it exists: tests/hicache, memkv as SGLang
#      HiCache's storage backend against SGLang's real classes.
#
# Options: --no-rust (skip step 2), --no-e2e (skip step 5), --setup (only step 1),
#          anything after `--` goes to every pytest call (e.g. -- -k config -x).
# Env: PYTHON (interpreter for .venv, default python3), E2E_TIMEOUT (seconds per vLLM venv, 1800),
#      MEMKV_REPORT_DIR (a folder for each pytest call's JUnit XML and this script's summary:
#      CI prints the slowest tests from them).
# Exit status: 0 when every step passed; a step that collects no tests counts as passed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

PY="${PYTHON:-python3}"
[[ -z "${MEMKV_REPORT_DIR:-}" ]] || mkdir -p "$MEMKV_REPORT_DIR"
VENV="$ROOT/.venv"
# Build and test dependencies of .venv; keep in step with pyproject's [test] extra.
DEPS=(maturin pytest hypothesis ruff mypy attrs pyyaml packaging numpy matplotlib redis hiredis
  # Only here, not in the [test] extra: the Kubernetes manifests' validation
  # (tests/test_deploy_k8s.py) is the same on every Python, so the wheel's venvs skip it.
  kubernetes-validate cloudcoil-models-prometheus-operator)
VLLM_VENVS=(.venv-vllm .venv-vllm-0.25)
# The tests' build of the extension: the wheel's features plus the test peer. A --features flag
# replaces pyproject.toml's [tool.maturin] features instead of adding to them: keep both in step.
MATURIN_DEVELOP=(develop --release --features pyo3/extension-module,test-peer)

run_rust=1 run_e2e=1 setup_only=0
PYTEST_ARGS=()
while (($#)); do
  case "$1" in
    --no-rust) run_rust=0 ;;
    --no-e2e) run_e2e=0 ;;
    --setup) setup_only=1 ;;
    --) shift; PYTEST_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "test.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

T0=$(date +%s)
declare -a SUMMARY=()
FAILED=0
log() { printf '\n==> [test %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
record() {  # record <name> <rc> <seconds>
  local verdict=PASS
  if [[ $2 -eq 5 ]]; then verdict="PASS (no tests collected)"
  elif [[ $2 -ne 0 ]]; then verdict="FAIL (exit $2)"; FAILED=1
  fi
  SUMMARY+=("$(printf '%-44s %-26s %5ss' "$1" "$verdict" "$3")")
}
step() {  # step <name> <command...>: run, record, never abort the script
  local name="$1" ts rc=0; shift
  log "$name"
  ts=$(date +%s)
  "$@" || rc=$?
  record "$name" "$rc" "$(( $(date +%s) - ts ))"
  return 0
}
summary() {
  {
    printf '\n==> summary (%ss total)\n' "$(( $(date +%s) - T0 ))"
    local line
    for line in "${SUMMARY[@]}"; do printf '    %s\n' "$line"; done
    ((FAILED == 0)) && echo "==> all passed" || echo "==> FAILED"
  } | if [[ -n "${MEMKV_REPORT_DIR:-}" ]]; then tee "$MEMKV_REPORT_DIR/test-summary.txt"; else cat; fi
}

# --- 1. .venv -----------------------------------------------------------------------------------
ensure_venv() {
  local stamp="$VENV/.memkv-deps" want
  want="${DEPS[*]}"
  if [[ -x "$VENV/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo ".venv up to date ($("$VENV/bin/python" --version))"
    return 0
  fi
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "${DEPS[@]}"
  echo "$want" > "$stamp"
  "$VENV/bin/python" -m pip list 2>/dev/null | grep -i -E '^(maturin|pytest|hypothesis|ruff|mypy) '
}
# The Redis backend's tests start a real Redis Cluster from the distribution's redis-server
# (redis-cli comes with it); without it they skip themselves, saying how to install it.
ensure_redis_server() {
  command -v redis-server >/dev/null && command -v redis-cli >/dev/null && return 0
  local sudo=()
  ((EUID == 0)) || sudo=(sudo -n)
  if command -v apt-get >/dev/null && "${sudo[@]}" true 2>/dev/null; then
    echo "installing redis-server (apt-get)"
    "${sudo[@]}" apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
      "${sudo[@]}" apt-get install -y -qq redis-server >/dev/null
  else
    echo "redis-server not installed and no apt-get/root here: the Redis backend tests will" \
      "skip (install redis-server, e.g. apt-get install redis-server)"
  fi
}
# The same backend tests run against a Valkey Cluster too (valkey-server, valkey-cli). Debian 12
# ships Valkey only in bookworm-backports: there the suite is enabled (Debian's own archive and
# keyring) for this one package; other systems install it from their own archive when it has it.
ensure_valkey_server() {
  command -v valkey-server >/dev/null && command -v valkey-cli >/dev/null && return 0
  local sudo=() suite
  ((EUID == 0)) || sudo=(sudo -n)
  if ! command -v apt-get >/dev/null || ! "${sudo[@]}" true 2>/dev/null; then
    echo "valkey-server not installed and no apt-get/root here: the Valkey runs of the Redis" \
      "backend tests will skip (install valkey-server)"
    return 0
  fi
  suite=$(. /etc/os-release && echo "${ID:-}-${VERSION_CODENAME:-}")
  if [[ "$suite" == debian-bookworm ]] && ! apt-cache policy valkey-server 2>/dev/null |
      grep -q 'Candidate: [0-9]'; then
    echo "enabling bookworm-backports for valkey-server (/etc/apt/sources.list.d/memkv-backports.sources)"
    printf '%s\n' "Types: deb" "URIs: http://deb.debian.org/debian" "Suites: bookworm-backports" \
      "Components: main" "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" |
      "${sudo[@]}" tee /etc/apt/sources.list.d/memkv-backports.sources >/dev/null
  fi
  echo "installing valkey-server (apt-get)"
  "${sudo[@]}" apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
    "${sudo[@]}" apt-get install -y -qq valkey-server >/dev/null
}
log "python venv $VENV"
ensure_venv
log "redis-server (Redis backend tests)"
ensure_redis_server
log "valkey-server (the Redis backend tests against Valkey)"
ensure_valkey_server || [[ "${CI:-}" != true ]] || exit 1
log "libfabric (the RDMA transport's tests run over its tcp provider on loopback)"
# A developer without root gets the message and the rest of the suite; CI must test that path.
bash "$ROOT/scripts/setup-libfabric.sh" || [[ "${CI:-}" != true ]] || exit 1
((setup_only)) && exit 0

command -v cargo >/dev/null || {
  echo "cargo not found: install Rust (https://rustup.rs: curl -sSf https://sh.rustup.rs | sh)" >&2
  exit 1
}
# PyO3's build script must see the same interpreter we install into; tests that embed Python
# need its shared library.
export PYO3_PYTHON="$VENV/bin/python"
PYLIBDIR="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')"
export LD_LIBRARY_PATH="${PYLIBDIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# --- 2. Rust ------------------------------------------------------------------------------------
if ((run_rust)); then
  step "cargo test --workspace --release" bash -c 'cd native && cargo test --workspace --release'
fi

# --- 3. build + install -------------------------------------------------------------------------
# shellcheck disable=SC2329  # invoked through step
build() {
  VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" "$VENV/bin/maturin" "${MATURIN_DEVELOP[@]}"
}
step "maturin develop --release --features test-peer (.venv)" build
built=1
# Without the extension the pure-Python tests still run (from the source tree); e2e cannot.
[[ "${SUMMARY[-1]}" == *FAIL* ]] && built=0

# --- 4. pytest in .venv -------------------------------------------------------------------------
junit() {  # junit <name>: JUNIT=(the pytest flag that writes MEMKV_REPORT_DIR/<name>.xml), if set
  JUNIT=()
  [[ -z "${MEMKV_REPORT_DIR:-}" ]] || JUNIT=("--junitxml=$MEMKV_REPORT_DIR/$1.xml")
}
junit venv
step "pytest tests/ (.venv)" "$VENV/bin/python" -m pytest tests -ra "${JUNIT[@]}" "${PYTEST_ARGS[@]}"

# --- 5. e2e with real vLLM ----------------------------------------------------------------------
# shellcheck disable=SC2329  # invoked through step
e2e_in() {  # e2e_in <venv> [integration-only]
  local venv="$1" only="${2:-}" dirs=() d
  # The torch round trips, the direct-mode offloader core and direct mode's worker and spec need
  # torch, which only the vLLM venvs have.
  for d in tests/tier tests/e2e tests/test_client_torch.py tests/offload tests/direct; do [[ -e $d ]] && dirs+=("$d"); done
  ((${#dirs[@]})) || { echo "no tests/tier or tests/e2e yet"; return 5; }
  # maturin develop installs editable: the extension lives in the source tree (built above), so
  # this only refreshes the metadata (entry point for vLLM's plugin loader) in the vLLM venv. The
  # same features as above, or it would rebuild the module without the test peer.
  VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" "$VENV/bin/maturin" "${MATURIN_DEVELOP[@]}" -q \
    || return 1
  junit "$(basename "$venv")"
  MEMKV_E2E_INTEGRATION_ONLY="$only" timeout --kill-after=30 "${E2E_TIMEOUT:-1800}" \
    "$venv/bin/python" -m pytest "${dirs[@]}" -ra "${JUNIT[@]}" "${PYTEST_ARGS[@]}"
}
if ((run_e2e && !built)); then
  SUMMARY+=("$(printf '%-44s %-26s' "e2e with real vLLM" "SKIPPED (build failed)")")
elif ((run_e2e)); then
  for v in "${VLLM_VENVS[@]}"; do
    name="pytest tests/tier tests/e2e torch ($v)"
    if [[ ! -x "$ROOT/$v/bin/python" ]]; then
      why="$v does not exist"
    elif ! "$ROOT/$v/bin/python" -c 'import vllm' 2>/dev/null; then
      why="vllm does not import in $v"
    else
      # The first venv is the newest vLLM: memkv's side of the e2e suite runs there only.
      # The multi-node suite (TP=2 engines over two network namespaces, 4-5 min) runs here too,
      # as root; it skips itself, saying why, where namespaces cannot be made.
      if [[ "$v" == "${VLLM_VENVS[0]}" ]]; then
        MEMKV_E2E_MULTINODE="${MEMKV_E2E_MULTINODE:-1}" step "$name" e2e_in "$ROOT/$v"
      else step "$name" e2e_in "$ROOT/$v" 1
      fi
      continue
    fi
    log "$name: SKIPPED, $why; bash scripts/setup-vllm.sh makes it"
    SUMMARY+=("$(printf '%-44s SKIPPED: %s' "$name" "$why")")
  done
fi

# --- 6. SGLang HiCache storage backend ----------------------------------------------------------
SGLANG_VENV=.venv-sglang
# shellcheck disable=SC2329  # invoked through step
sglang_in() {  # the servers are the build just installed into .venv (step 3)
  junit sglang
  MEMKV_BIN="${MEMKV_BIN:-$VENV/bin/memkv}" timeout --kill-after=30 "${E2E_TIMEOUT:-1800}" \
    "$ROOT/$SGLANG_VENV/bin/python" -m pytest tests/hicache -ra "${JUNIT[@]}" "${PYTEST_ARGS[@]}"
}
if ((run_e2e && built)); then
  name="pytest tests/hicache ($SGLANG_VENV)"
  if [[ ! -x "$ROOT/$SGLANG_VENV/bin/python" ]]; then
    why="$SGLANG_VENV does not exist"
  elif ! "$ROOT/$SGLANG_VENV/bin/python" -c 'import sglang.srt.mem_cache.hicache_storage' \
      2>/dev/null; then
    why="SGLang's mem_cache does not import in $SGLANG_VENV"
  else
    why=""
    step "$name" sglang_in
  fi
  if [[ -n "$why" ]]; then
    log "$name: SKIPPED, $why; bash scripts/setup-sglang.sh makes it"
    SUMMARY+=("$(printf '%-44s SKIPPED: %s' "$name" "$why")")
  fi
fi

summary
exit "$FAILED"
