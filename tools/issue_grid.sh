#!/usr/bin/env bash
# The Hopper issue's whole grid, next to cuDNN and FlashAttention-2 in one process per pass, and
# ncu of the cells that fall short (both libraries' kernels in one ncu process). One device call:
#
#   OUT=dir [PASSES=2] [PART=grid|ncu|all] bash tools/issue_grid.sh
#
# grid: forward d = 64/128/256 and backward d = 64/128, N = 1k..16k, causal and not, bf16 and fp16
#       (final_check.sh's grid is bf16 + fp16 at d=128 only, N without 8k: its time limit);
#       PASSES passes (default 2: the ratios' run-to-run spread), fwd_<p>.json / bwd_<p>.json.
# ncu:  tools/ncu_peers.py under ncu with --profile-from-start off: every kernel of one call of
#       each op (cuDNN's and cuflash's), tensor-pipe and issue activity, instructions executed, the
#       SMs' active share of the kernel's cycles (idle tails) and the stall reasons
#       (warps stalled per issued instruction), summarized per kernel in ncu_short.txt.
# Everything but the summaries goes into grid.tar.gz (a device call brings back at most 8 files).
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
PART=${PART:-all}
work=$(mktemp -d)
if [ "$PART" != ncu ]; then
    for p in $(seq 1 "${PASSES:-2}"); do
        timeout "${FWD_TIMEOUT:-200}" python3 benchmarks/peers.py --ops fwd --dtypes bfloat16,float16 --d 64,128,256 \
            --n 1024,2048,4096,8192,16384 --impls torch-flash,torch-cudnn,cuflash \
            --out "$work/fwd_$p.json" > "$work/fwd_$p.log" 2>&1; echo "fwd pass $p rc=$?"
        timeout "${BWD_TIMEOUT:-200}" python3 benchmarks/peers.py --ops bwd --dtypes bfloat16,float16 --d 64,128 \
            --n 1024,2048,4096,8192,16384 --impls torch-flash,torch-cudnn,cuflash \
            --out "$work/bwd_$p.json" > "$work/bwd_$p.log" 2>&1; echo "bwd pass $p rc=$?"
    done
    python3 tools/grid_table.py "$work"/fwd_*.json "$work"/bwd_*.json > "$OUT/grid.txt" 2>&1
    cat "$OUT/grid.txt"
fi
if [ "$PART" != grid ]; then
    metrics="regex:^(smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio|sm__pipe_tensor.*cycles_active\.avg\.pct_of_peak_sustained_active|sm__inst_executed_pipe_xu\.avg\.pct_of_peak_sustained_active|smsp__issue_active\.avg\.pct_of_peak_sustained_active|dram__throughput\.avg\.pct_of_peak_sustained_elapsed|gpu__time_duration\.sum|smsp__inst_executed\.sum|sm__cycles_active\.avg|sm__cycles_elapsed\.avg)$"
    # fwd: d, N, causal; bwd likewise; decode: B, Hkv, L
    export NCU_OPS=${NCU_OPS:-"fwd:64,1024,0;fwd:64,1024,1;fwd:64,2048,1;fwd:128,1024,0;fwd:128,4096,0;fwd:256,1024,0;fwd:256,1024,1;bwd:64,4096,0;bwd:128,4096,0;decode:8,32,4096"}
    timeout "${NCU_TIMEOUT:-300}" ncu --clock-control none --profile-from-start off --metrics "$metrics" \
        python3 tools/ncu_peers.py > "$work/ncu_short_raw.txt" 2>&1; echo "ncu rc=$?"
    python3 tools/ncu_digest.py "$work/ncu_short_raw.txt" > "$OUT/ncu_short.txt" 2>&1
    cat "$OUT/ncu_short.txt"
fi
tar -czf "$OUT/grid.tar.gz" -C "$work" .
