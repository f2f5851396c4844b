#!/usr/bin/env bash
# Runs a command on a GPU host with the bundle scripts/gpu-bundle.sh built (.gpu-bundle/ carried
# to the same place in this checkout): installs it into $GPU_SITE (default /tmp/site) once, sets
# the environment vLLM engines need there, and runs the command from the repository root.
#
#   scripts/gpu-run.sh python -m pytest tests/gpu -q -rs
#   scripts/gpu-run.sh python benchmarks/gpu_ttft.py --prefixes 2048,8192
#
# The host must have Python 3.12 with torch 2.11 + CUDA 13 (what vLLM 0.26.0 pins) as `python3`
# (or $PYTHON). "python" at the start of the command means that interpreter. The checkout's
# memkv_vllm is the one imported (first on PYTHONPATH); the native extension comes from the
# bundle's wheel, so rebuild the bundle after a change under native/.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
BUNDLE=${GPU_BUNDLE:-$ROOT/.gpu-bundle}
SITE=${GPU_SITE:-/tmp/site}
PY=${PYTHON:-python3}
[ $# -gt 0 ] || { echo "usage: scripts/gpu-run.sh COMMAND [ARG...]" >&2; exit 2; }
[ -s "$BUNDLE/vllm-slim.tar.xz" ] || {
  echo "gpu-run: no bundle at $BUNDLE (build it with scripts/gpu-bundle.sh and carry it)" >&2
  exit 2
}
t0=$(date +%s)
if [ ! -f "$SITE/.memkv-gpu-bundle" ]; then
  wheels=("$BUNDLE"/wheels/*.whl)
  echo "[gpu-run] installing ${#wheels[@]} wheels and vLLM into $SITE"
  PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --disable-pip-version-check \
    --target "$SITE" "${wheels[@]}"
  tar -xJf "$BUNDLE/vllm-slim.tar.xz" -C "$SITE"
  touch "$SITE/.memkv-gpu-bundle"
fi
# The checkout's memkv_vllm shadows the wheel's: give it the wheel's native extension.
cp "$SITE"/memkv_vllm/_native*.so "$ROOT/memkv_vllm/"

export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
# The bundle's server command, for the tests' fixtures (else they run python -m memkv_vllm.cli).
[ -x "$SITE/bin/memkv" ] && export MEMKV_BIN="$SITE/bin/memkv"
# flashinfer is not carried, and vLLM 0.26's sampler imports it unless told not to.
export VLLM_USE_FLASHINFER_SAMPLER=0
# No registry or model hub is reachable: models are made locally with random weights.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# The same prefix hashes in every engine process (tier mode's keys derive from them).
export PYTHONHASHSEED=0 PYTHONUNBUFFERED=1
# NVLink multicast stays off: on a shared host it can take the GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
"$PY" - <<'PY'
import torch, vllm, memkv_vllm
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print(f"[gpu-run] torch {torch.__version__}, vLLM {vllm.__version__}, {gpu}, "
      f"memkv_vllm from {memkv_vllm.__file__}", flush=True)
PY
echo "[gpu-run] ready in $(( $(date +%s) - t0 ))s: $*"
if [ "$1" = python ]; then
  shift
  exec "$PY" "$@"
fi
exec "$@"
