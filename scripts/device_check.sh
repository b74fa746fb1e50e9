#!/usr/bin/env bash
# The GPU checks, as one call on a GPU machine (under 8 minutes; each step has its own time limit so
# one hang cannot eat the rest):
#   1. the Triton paged-attention and KV-write kernels compiled for real (not the interpreter) against
#      the float64 oracle and the torch path: tests/test_triton_attention.py (and Gated DeltaNet's decode kernel, tests/test_triton_gated_delta.py,
#      and the LoRA shrink/expand kernels, tests/test_triton_lora.py) with FASTGEN_TRITON_DEVICE=cuda
#   2. CUDA-graph capture and replay of every planned bucket against eager, base model and LoRA adapters:
#      tests/test_compiled_runner.py
#   3. scripts/bench_graphs.py (per-bucket step time eager / compiled / graphs, capture cost, batch-1 bandwidth)
#   4. scripts/bench_attention.py (Triton kernel vs torch reference)
#   5. scripts/bench_peer.py's fastgen row (start-up, tok/s) on the 0.5B Llama shape
#   6. weight offload on the GPU: tests/test_offload.py (pinned host buffers, side stream, events; disk
#      through pinned staging) and scripts/bench_offload.py on a 0.7B Llama shape
# It writes one JSON, $OUT/device_check.json (OUT defaults to bench_results/device), holding each
# step's exit status, seconds and output tail, with every bench's own JSON merged in.
#
#     bash scripts/device_check.sh            # on the GPU machine, from the repository root
#
# The machine has torch, triton, transformers, safetensors, tqdm, numpy and grpcio but no registry:
# fastgen itself is installed from this tree without dependencies.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-bench_results/device}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET

"$PY" -m pip install --quiet --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || echo "fastgen did not install (see $OUT/install.log); the steps below will fail to import it"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1

# The whole call stays under 8 minutes: a step's limit is cut to what is left of DEADLINE_S, and a
# step with under 15 s left is skipped (recorded with rc "skipped").
DEADLINE_S=${DEADLINE_S:-470}

# step NAME LIMIT_S COMMAND...: run one check, recording its status, wall time and output tail.
step() {
    local name=$1 limit=$2
    shift 2
    if (( SECONDS + limit > DEADLINE_S )); then limit=$((DEADLINE_S - SECONDS)); fi
    if (( limit < 15 )); then
        echo "== $name skipped: the call's ${DEADLINE_S}s are spent"
        echo '{"rc": "skipped", "seconds": 0}' >"$OUT/$name.status"
        return
    fi
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "{\"rc\": $rc, \"seconds\": $((SECONDS - start))}" >"$OUT/$name.status"
    tail -n 5 "$OUT/$name.log"
}

# Not tests/test_paged_attention.py: it runs Triton on CPU tensors through the interpreter, process-wide.
step triton_kernels 120 env FASTGEN_TRITON_DEVICE=cuda "$PY" -m pytest -q -x -p no:cacheprovider \
    tests/test_triton_attention.py tests/test_triton_gated_delta.py tests/test_triton_lora.py
step cuda_graphs 120 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_compiled_runner.py -k "cuda_graphs"
step bench_graphs 120 "$PY" scripts/bench_graphs.py --out "$OUT/graphs.json"
step bench_attention 60 "$PY" scripts/bench_attention.py --json "$OUT/attention.json"
step bench_peer 150 "$PY" scripts/bench_peer.py --engines fastgen --models llama-0.5b \
    --json "$OUT/peer.json" --plot "$OUT/peer.png"
step offload 150 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_offload.py
step bench_offload 240 "$PY" scripts/bench_offload.py --layers 24 --hidden 1536 --out "$OUT/offload.json"

"$PY" - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
report = {"gpu": open(os.path.join(out, "gpu.txt")).read().strip(), "steps": {}}
for name in ("triton_kernels", "cuda_graphs", "bench_graphs", "bench_attention", "bench_peer", "offload",
             "bench_offload"):
    entry = {"rc": None, "seconds": None}
    if os.path.exists(os.path.join(out, f"{name}.status")):
        entry.update(json.load(open(os.path.join(out, f"{name}.status"))))
    log = os.path.join(out, f"{name}.log")
    entry["tail"] = open(log).read()[-3000:] if os.path.exists(log) else ""
    bench = {"bench_graphs": "graphs.json", "bench_attention": "attention.json", "bench_peer": "peer.json",
             "bench_offload": "offload.json"}.get(name)
    if bench and os.path.exists(os.path.join(out, bench)):
        entry["results"] = json.load(open(os.path.join(out, bench)))
    report["steps"][name] = entry
json.dump(report, open(os.path.join(out, "device_check.json"), "w"), indent=1)
print(json.dumps({k: (v["rc"], v["seconds"]) for k, v in report["steps"].items()}))
EOF
