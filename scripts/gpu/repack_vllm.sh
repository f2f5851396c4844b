#!/usr/bin/env bash
# Repack vLLM's CUDA wheel into a slim tree for one Hopper GPU (sm_90), Triton attention only.
#
#   scripts/gpu/repack_vllm.sh WHEEL OUT.tar.xz
#
# What goes, and why the rest still runs (the engines must use attention_backend TRITON_ATTN):
# - vllm_flash_attn's _vllm_fa2_C / _vllm_fa3_C (458 MB), third_party/deep_gemm and fmha_sm100
#   (headers and cubins), the vllm-rs front-end binary, and _moe_C (its import is optional);
# - vllm_flash_attn/__init__.py raises ImportError without its .so files, and on CUDA every model
#   imports it: that raise is disabled;
# - the .so files are stripped, and the CUDA images for other architectures than sm_90 in
#   _C_stable_libtorch are zeroed (fatbin.py prune: layout unchanged, so it compresses well).
set -euo pipefail
WHEEL=$(realpath "$1")
OUTF=$(realpath -m "$2")
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
W=$(mktemp -d "${TMPDIR:-/tmp}/vllm-repack.XXXXXX")
trap 'rm -rf "$W"' EXIT
cd "$W"
echo "[repack] unpacking $(basename "$WHEEL")"
unzip -q "$WHEEL"
DIST=$(echo vllm-*.dist-info)
[ -d "$DIST" ] || { echo "repack: no vllm-*.dist-info in $WHEEL" >&2; exit 1; }
rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so
rm -rf vllm/third_party/deep_gemm vllm/third_party/fmha_sm100
rm -f vllm/vllm-rs vllm/_moe_C_stable_libtorch.abi3.so
"$PY" - <<'PY'
p = "vllm/vllm_flash_attn/__init__.py"
s = open(p).read()
old = """if not (FA2_AVAILABLE or FA3_AVAILABLE):
    raise ImportError("""
assert old in s, "vllm_flash_attn/__init__.py changed: the repack's patch needs a new look"
s = s.replace(old, """if False and not (FA2_AVAILABLE or FA3_AVAILABLE):  # FA .so files stripped
    raise ImportError(""")
open(p, "w").write(s)
PY
echo "[repack] stripping the .so files"
for f in vllm/*.so vllm/*/*.so; do [ -f "$f" ] && strip --strip-unneeded "$f"; done
echo "[repack] pruning CUDA images to sm_90"
"$PY" "$HERE/fatbin.py" prune vllm/_C_stable_libtorch.abi3.so 90 vllm/_C.pruned | tail -2
mv vllm/_C.pruned vllm/_C_stable_libtorch.abi3.so
chmod 755 vllm/_C_stable_libtorch.abi3.so
find . -name __pycache__ -prune -exec rm -rf {} +
echo "[repack] compressing (xz, a few minutes on 2 cores)"
XZ_OPT="-6 -T0" tar -cJf "$OUTF" vllm "$DIST"
ls -la "$OUTF"
