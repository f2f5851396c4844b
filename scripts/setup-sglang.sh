#!/usr/bin/env bash
# Creates .venv-sglang, where tests/hicache run memkv as SGLang HiCache's storage backend against
# SGLang's real classes: sglang (SGLANG_VERSION, default the newest on the index) --no-deps, plus
# the few packages its mem_cache modules import on a CPU-only host (docs/sglang.md says which
# and why). Everything else, torch first, comes from the newest vLLM venv (.venv-vllm, made by
# scripts/setup-vllm.sh): a .pth file puts its site-packages behind this venv's own. PyPI's torch
# with its CUDA libraries is ~5 GB and 6 minutes here; the PyTorch CPU index is not reachable
# from CI. So this venv costs ~40 MB and about a minute.
#
# Idempotent: a venv with the wanted sglang over the same vLLM venv is left alone.
# Env: SGLANG_VERSION=<ver>, VLLM_VENV=<dir> (default .venv-vllm), SETUP_LOG=<file> (pip's output;
#      default .cache/setup-sglang.log). Exits 0 with a message when the vLLM venv is missing:
#      tests/hicache then skip themselves, saying why.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv-sglang"
BASE="${VLLM_VENV:-$ROOT/.venv-vllm}"
[[ "$BASE" == /* ]] || BASE="$ROOT/$BASE"
mkdir -p "$ROOT/.cache"
LOG="${SETUP_LOG:-$ROOT/.cache/setup-sglang.log}"
: > "$LOG"
t0=$(date +%s)
step() { echo "[setup-sglang $(( $(date +%s) - t0 ))s] $*"; }
pip() { env PIP_PROGRESS_BAR=off "$VENV/bin/python" -m pip "$@" >> "$LOG" 2>&1 ||
  { tail -20 "$LOG" >&2; echo "setup-sglang: pip $* failed; full output in $LOG" >&2; exit 1; }; }

# The torch of the vLLM venv, from its metadata (importing torch takes seconds).
torch_version() { "$BASE/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))'; }
if [[ ! -x "$BASE/bin/python" ]] || ! torch_version >/dev/null 2>&1; then
  step "no torch in $BASE (scripts/setup-vllm.sh makes it): .venv-sglang not made," \
    "tests/hicache will skip"
  exit 0
fi
VER="${SGLANG_VERSION:-$("$PY" -m pip index versions sglang 2>/dev/null \
  | sed -n 's/^sglang (\(.*\))$/\1/p' | head -1)}"
[[ -n "$VER" ]] || { echo "setup-sglang: cannot find sglang's newest version" >&2; exit 1; }
SITE="$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
TORCH="$(torch_version)"; TORCH="${TORCH%%+*}"
want="sglang $VER over $SITE (torch $TORCH)"
if [[ -f "$VENV/.memkv-setup-ok" && "$(cat "$VENV/.memkv-setup-ok")" == "$want" ]]; then
  step "$want already installed"
  exit 0
fi
step "creating $VENV: $want (log: $LOG)"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
# Behind this venv's own site-packages ("zz"), so what is installed here wins.
echo "$SITE" > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-memkv-vllm-venv.pth"
# torchvision must match the vLLM venv's torch (torch 2.N pairs with torchvision 0.(N+15));
# sglang's model configs import it, vLLM's venv leaves it out.
minor="${TORCH#2.}"; minor="${minor%%.*}"
step "sglang==$VER --no-deps; orjson, gguf, ipython, torchvision==0.$((minor + 15)).* (torch $TORCH)"
pip install --no-deps "sglang==$VER" orjson gguf "torchvision==0.$((minor + 15)).*"
pip install ipython
"$VENV/bin/python" -c 'import sglang.srt.mem_cache.hicache_storage, sglang.srt.mem_cache.pool_host.mla, sglang.srt.mem_cache.memory_pool' 2>>"$LOG" \
  || { tail -20 "$LOG" >&2; echo "setup-sglang: SGLang's mem_cache does not import" >&2; exit 1; }
echo "$want" > "$VENV/.memkv-setup-ok"
step "done ($(du -sh "$VENV" | cut -f1))"
