#!/usr/bin/env bash
# A/B of a kernel change in one device call, forward (d 64/128/256, N 1k-4k) and backward (N=4k)
# next to cuDNN: snapA (before; prepare: git archive <before> | tar -x -C snapA) and this tree
# alternated, in one process per run. Written for warp_uniform (09ce6a1, whose backward also read
# its warpgroup index from lane 0; since 34dd81e only the forward does, outside non-causal d=128).
#   OUT=dir bash tools/uniform_probe.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1
root=$PWD
SNAPS="A HEAD A HEAD" AB_D=64,128,256 AB_N=1024,2048,4096 BENCH_TIMEOUT=70 TEST_TIMEOUT=0 bash tools/fwd_ab.sh | tee "$OUT/ab_summary.txt"
i=0
for s in A HEAD A HEAD; do
    i=$((i + 1)); dir=$root/snap$s; [ "$s" = HEAD ] && dir=$root
    (cd "$dir" && PYTHONPATH=$PWD timeout 80 python3 benchmarks/peers.py --ops bwd --impls cuflash,torch-cudnn --d 64,128,256 \
        --n 4096 --seconds-per-impl 0.6 --max-seconds 70 --out "$OUT/bwd_${s}_$i.json" > "$OUT/bwd_${s}_$i.log" 2>&1; echo "bwd $s rc=$?")
done
python3 tools/ab_summary.py ABBWD "$OUT/bwd_*_*.json" | tee -a "$OUT/ab_summary.txt"
mkdir -p "$OUT/raw" && mv "$OUT"/fwd_*_*.json "$OUT"/fwd_*_*.log "$OUT"/bwd_*_*.json "$OUT"/bwd_*_*.log "$OUT/raw/" 2>/dev/null; tar czf "$OUT/raw.tgz" -C "$OUT" raw && rm -rf "$OUT/raw"
