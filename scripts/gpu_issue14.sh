#!/usr/bin/env bash
# One call on a multi-GPU kind (nvidia-h200-x2 or -x4) for issue 14 (installs nothing): the
# GPU-marked distributed tests (TP=2 == TP=1 fp32 with graphs, bf16 teacher-forced, DCP
# capacity, MoE and shape TP on two GPUs), then W1 on the Llama-3.1-8B shape at TP=1/2 (and 4
# with four GPUs) and the KV capacity at DCP=1/2. Logs and JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pagedkv-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ngpu=$(nvidia-smi -L | wc -l)
{ nvidia-smi --query-gpu=name --format=csv,noheader | head -1; echo "gpus $ngpu"; cat COMMIT 2>/dev/null; } \
  | tee "$OUT/env.txt"
timeout ${T_TESTS:-240} python3 -m pytest -q -p no:cacheprovider -m gpu tests/distributed -rfE \
  > "$OUT/distributed_tests.log" 2>&1; tail -8 "$OUT/distributed_tests.log"
sizes="1 2"; [ "$ngpu" -ge 4 ] && sizes="1 2 4"
for tp in $sizes; do
  echo "== W1 llama-3.1-8b TP=$tp"
  timeout ${T_W1:-150} python3 bench/bench_w1.py --shape llama-3.1-8b -tp "$tp" \
    --json "$OUT/w1_llama8b_tp$tp.json" > "$OUT/w1_llama8b_tp$tp.log" 2>&1
  grep -E "KV cache|output throughput|tok/s" "$OUT/w1_llama8b_tp$tp.log" | tail -3
done
# the largest context a request can hold: a single-KV-head shard layout needs TP > KV heads;
# Llama-3.1-8B has 8, so at TP <= 8 DCP only re-splits heads (same tokens): report both
python3 - <<'PY' 2>&1 | tee "$OUT/dcp_capacity.txt"
from pagedkv import LLM
for dcp in (1, 2):
    llm = LLM.from_shape("llama-3.1-8b", tensor_parallel_size=2, decode_context_parallel_size=dcp,
                         attention_backend="torch_ref", max_model_len=131072)
    s = llm.kv_cache_sizing
    print(f"TP=2 DCP={dcp}: {s.num_blocks} blocks x {s.block_size} tokens = {s.token_capacity:,} tokens")
    llm.shutdown()
PY
