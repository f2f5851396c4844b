#!/usr/bin/env bash
# The release artifacts, as one command: bash scripts/build-wheels.sh
#
#   1. makes .venv-wheel (maturin, zig from the `ziglang` wheel, auditwheel) if missing or out of
#      date: nothing but PyPI and crates.io is needed, no system compiler or glibc of the target;
#   2. builds the sdist (maturin sdist) into dist/ and checks that it holds the project, the Rust
#      workspace and its lock file;
#   3. for each target (WHEEL_TARGETS, default x86_64): one abi3 wheel (cp310-abi3: every CPython
#      from 3.10 on), compiled with `maturin build --release --zig --compatibility manylinux_2_28`:
#      zig links against glibc 2.28's symbols, so the wheel installs on RHEL/Rocky 8, Debian 10,
#      Ubuntu 18.10 and later. The `memkv` command is the wheel's console script
#      (memkv_vllm/cli.py into the extension's memkv-cli), so the wheel alone gives it;
#   4. checks each wheel: its file name carries manylinux_2_28 and abi3, and `auditwheel show`
#      finds it consistent with manylinux_2_28 and naming no library outside the manylinux
#      policy (libfabric is dlopen'd at first use, never linked: memkv-fabric). The report goes
#      to dist/<wheel>.auditwheel.txt beside the wheel; the size is printed.
#
# Env: WHEEL_TARGETS  space-separated Rust target triples, default "x86_64-unknown-linux-gnu";
#                     add aarch64-unknown-linux-gnu for the ARM wheel (needs
#                     `rustup target add aarch64-unknown-linux-gnu`; zig cross-links it),
#      PYTHON         interpreter for .venv-wheel (default python3),
#      DIST           output folder (default dist/).
# Exit status: 0 when every artifact was built and passed its checks.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

PY="${PYTHON:-python3}"
WVENV="$ROOT/.venv-wheel"
DIST="${DIST:-$ROOT/dist}"
TARGETS="${WHEEL_TARGETS:-x86_64-unknown-linux-gnu}"
# ziglang below 0.15: maturin's zig wrapper is tested against those releases.
DEPS=("maturin>=1.7,<2" "ziglang>=0.13,<0.15" "auditwheel>=6")
POLICY=manylinux_2_28

T0=$(date +%s)
log() { printf '\n==> [wheels %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }

log "build venv $WVENV (${DEPS[*]})"
stamp="$WVENV/.memkv-deps"
if [[ -x "$WVENV/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "${DEPS[*]}" ]]; then
  echo ".venv-wheel up to date"
else
  [[ -x "$WVENV/bin/python" ]] || "$PY" -m venv "$WVENV"
  "$WVENV/bin/python" -m pip install -q --upgrade pip
  "$WVENV/bin/python" -m pip install -q "${DEPS[@]}"
  echo "${DEPS[*]}" > "$stamp"
fi
# maturin finds zig as `python3 -m ziglang` of the venv first on PATH.
export PATH="$WVENV/bin:$PATH"
command -v cargo >/dev/null || {
  echo "cargo not found: building wheels needs Rust (https://rustup.rs)" >&2
  exit 1
}
mkdir -p "$DIST"

log "sdist"
rm -f "$DIST"/memkv_vllm-*.tar.gz
maturin sdist --out "$DIST"
sdist=$(ls "$DIST"/memkv_vllm-*.tar.gz)
# What `pip install` of the sdist builds from: the project, the Rust workspace and its lock file.
listing=$(tar tzf "$sdist")
for f in pyproject.toml native/Cargo.lock native/crates/memkv-py/Cargo.toml memkv_vllm/cli.py; do
  grep -q "^memkv_vllm-[^/]*/$f\$" <<<"$listing" || { echo "FAIL: $f is not in $sdist" >&2; exit 1; }
done
echo "sdist $(basename "$sdist"): $(stat -c %s "$sdist") bytes, $(grep -c . <<<"$listing") files"

check_wheel() {  # check_wheel <wheel>: tag, auditwheel report, size
  local whl="$1" report="$1.auditwheel.txt"
  case "$(basename "$whl")" in
    *-cp310-abi3-*"$POLICY"*) ;;
    *) echo "FAIL: $(basename "$whl") is not a cp310-abi3 $POLICY wheel" >&2; return 1 ;;
  esac
  auditwheel show "$whl" | tee "$report"
  # auditwheel's verdict on the tag, and no library it would have to bundle (one outside the
  # policy's allowed system libraries would be listed after "system libraries" as needed).
  # (auditwheel wraps its lines: compare with the whitespace squeezed.)
  tr -s ' \n' '  ' <"$report" | grep -q "is consistent with the following platform tag: \"$POLICY" || {
    echo "FAIL: auditwheel does not find $(basename "$whl") consistent with $POLICY" >&2
    return 1
  }
  if grep -q "libfabric" "$report"; then
    echo "FAIL: $(basename "$whl") links libfabric (it must be dlopen'd)" >&2
    return 1
  fi
  printf 'wheel %s: %s bytes (%s)\n' "$(basename "$whl")" "$(stat -c %s "$whl")" \
    "$(du -h "$whl" | cut -f1)"
}

for target in $TARGETS; do
  arch="${target%%-*}"
  log "wheel for $target (maturin --zig, $POLICY); a release build, minutes on 2 cores"
  # (A Rust without rustup, e.g. the distribution's, builds for its own host only.)
  if command -v rustup >/dev/null && ! rustup target list --installed | grep -qx "$target"; then
    echo "FAIL: Rust target $target is not installed: rustup target add $target" >&2
    exit 1
  fi
  rm -f "$DIST"/memkv_vllm-*-"${POLICY}_${arch}".whl "$DIST"/memkv_vllm-*-"${POLICY}_${arch}".whl.*
  maturin build --release --zig --compatibility "$POLICY" --target "$target" --out "$DIST"
  whl=$(ls "$DIST"/memkv_vllm-*-"${POLICY}_${arch}".whl)
  log "auditwheel show $(basename "$whl")"
  check_wheel "$whl"
done
log "done: $(find "$DIST" -maxdepth 1 -name 'memkv_vllm-*' -printf '%f ')"
