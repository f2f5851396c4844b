#!/usr/bin/env bash
# Builds .gpu-bundle/: what a GPU host without a package registry needs, beside its own torch, to
# run vLLM engines with memkv-vllm (tests/gpu, benchmarks/gpu_ttft.py). Run it here, on a machine
# with PyPI access; carry .gpu-bundle to the GPU host and run commands there with
# scripts/gpu-run.sh (it installs the bundle into /tmp/site in a few seconds).
#
#   scripts/gpu-bundle.sh            (idempotent: downloads and the repack are cached)
#
# The bundle, for Python 3.12 on x86-64 Linux with torch 2.11 + CUDA 13 already installed
# (vLLM 0.26.0's CUDA wheel pins that torch), one Hopper GPU (sm_90):
#   vllm-slim.tar.xz   vLLM's CUDA tree without flash-attn, DeepGEMM and the other-arch CUDA
#                      images (scripts/gpu/repack_vllm.sh says what goes and why)
#   wheels/*.whl       vLLM's Python dependencies that such a host lacks (scripts/gpu/carry-deps.txt)
#                      and memkv-vllm's own abi3 wheel (maturin build --release)
# About 46 MiB in all; the script fails if the bundle passes BUNDLE_LIMIT_MB (default 60), so it
# and the repository fit a 64 MiB transfer.
# Env: VLLM_VERSION (0.26.0), PY_VERSION (3.12), GLIBC_MINOR (31: the newest manylinux_2_N wheels
#      taken), PIP (python3 -m pip), PYTHON (python3, runs the repack), MATURIN (.venv/bin/maturin, else maturin), BUNDLE_LIMIT_MB (60).
# How carry-deps.txt was found: scripts/gpu/import_probe.py imports vLLM's engine path with the
# CUDA platform forced; on a machine without a GPU it needs a stub libcuda.so.1
# (scripts/gpu/stub_libcuda.c). Each missing module was installed until every module imported;
# the list is what that venv held beyond the GPU image's packages.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
VLLM_VERSION=${VLLM_VERSION:-0.26.0}
PY_VERSION=${PY_VERSION:-3.12}
GLIBC_MINOR=${GLIBC_MINOR:-31}
read -r -a PIP <<< "${PIP:-python3 -m pip}"
MATURIN=${MATURIN:-$( [ -x "$ROOT/.venv/bin/maturin" ] && echo "$ROOT/.venv/bin/maturin" || echo maturin)}
LIMIT_MB=${BUNDLE_LIMIT_MB:-60}
CACHE="$ROOT/.cache/gpu-bundle"
OUT="$ROOT/.gpu-bundle"
t0=$(date +%s)
step() { echo "[gpu-bundle $(( $(date +%s) - t0 ))s] $*"; }

# A long command with a progress line every 20 s (elapsed time and what it printed last).
progress() {  # progress <what> <log> <command...>
  local what=$1 log=$2 pid rc=0 last
  shift 2
  "$@" > "$log" 2>&1 &
  pid=$!
  last=$(date +%s)
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if (( $(date +%s) - last >= 20 )); then
      last=$(date +%s)
      echo "    ... $what: $(( last - t0 ))s, $(tail -c 2000 "$log" | tr '\r' '\n' \
        | grep -v '^\s*$' | tail -1 | cut -c1-100)"
    fi
  done
  wait "$pid" || rc=$?
  if ((rc)); then
    tail -30 "$log" >&2
    echo "gpu-bundle: $what failed (exit $rc); log: $log" >&2
    exit "$rc"
  fi
}

# pip matches manylinux_2_N tags exactly: name every glibc from 2.17 up to the host's (2.31:
# llguidance's wheel needs it; the GPU host's Python 3.12 image has a newer glibc).
PLATFORMS=()
for ((n = GLIBC_MINOR; n >= 17; n--)); do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
pip_download() {  # pip_download <dir> <requirement...>
  local dir=$1
  shift
  "${PIP[@]}" download --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp "${PLATFORMS[@]}" --progress-bar off -d "$dir" "$@"
}

mkdir -p "$CACHE/vllm" "$OUT/wheels"

shopt -s nullglob
found=("$CACHE"/vllm/vllm-"$VLLM_VERSION"-*.whl)
if [ ${#found[@]} -eq 0 ]; then
  step "downloading vLLM $VLLM_VERSION's CUDA wheel (about 300 MB)"
  progress "vLLM download" "$CACHE/vllm-download.log" pip_download "$CACHE/vllm" "vllm==$VLLM_VERSION"
  found=("$CACHE"/vllm/vllm-"$VLLM_VERSION"-*.whl)
fi
WHEEL=${found[0]}
step "vLLM wheel: $(basename "$WHEEL")"

SLIM="$OUT/vllm-slim.tar.xz"
if [ ! -s "$SLIM" ] || [ "$WHEEL" -nt "$SLIM" ] || [ scripts/gpu/repack_vllm.sh -nt "$SLIM" ]; then
  step "repacking vLLM into $SLIM"
  progress "repack" "$CACHE/repack.log" scripts/gpu/repack_vllm.sh "$WHEEL" "$SLIM.part"
  mv "$SLIM.part" "$SLIM"
fi

step "downloading the dependency wheels (scripts/gpu/carry-deps.txt; pip's cache keeps them)"
mapfile -t DEPS < <(grep -Ev '^\s*(#|$)' scripts/gpu/carry-deps.txt)
rm -f "$OUT"/wheels/*.whl
progress "dependency download" "$CACHE/deps-download.log" pip_download "$OUT/wheels" "${DEPS[@]}"

step "building memkv-vllm's wheel (maturin build --release; the first build compiles the workspace)"
rm -rf "$CACHE/memkv"
progress "maturin build" "$CACHE/maturin.log" "$MATURIN" build --release --out "$CACHE/memkv"
cp "$CACHE"/memkv/memkv_vllm-*.whl "$OUT/wheels/"
wheels=("$OUT"/wheels/*.whl)

size_kb=$(du -sk "$OUT" | cut -f1)
step "done: $OUT, $(( size_kb / 1024 )) MiB (${#wheels[@]} wheels + vLLM's slim tree)"
if (( size_kb > LIMIT_MB * 1024 )); then
  echo "gpu-bundle: the bundle passes $LIMIT_MB MiB" >&2
  exit 1
fi
