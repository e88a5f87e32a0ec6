#!/usr/bin/env bash
# The stale running max (OnlineSoftmax STALE) where it is not on yet, in one device call:
#  - wgmma forward with CUFLASH_FWD_STALE_MIN_D=192 (d=192 too) against the default (d=256 only),
#    next to cuDNN, alternated A B A B (tools/hopper_fwd_sweep.py: its d=192 and d=256 tiles, each
#    checked first; the d=256 rows must not move);
#  - decode with CUFLASH_DECODE_STALE=1 against 0 (tools/decode_trace.py, planner's choice);
#  - the d=192 forward and decode GPU tests with both switches on.
#   OUT=dir bash tools/stale_probe.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
tmp=$(mktemp -d)  # the runs' files, packed into $OUT/raw.tgz at the end (a call returns at most 8 files)
for run in 1 2; do
    for variant in base stale192; do
        opts=""; [ "$variant" = stale192 ] && opts="-DCUFLASH_FWD_STALE_MIN_D=192"
        CUFLASH_NVRTC_OPTIONS="$opts" timeout 90 python3 tools/hopper_fwd_sweep.py --d 192,256 --n 1024,4096 \
            --json "$tmp/fwd_${variant}_$run.json" > "$tmp/fwd_${variant}_$run.log" 2>&1
        echo "fwd $variant run $run rc=$?"
    done
    for st in 0 1; do
        CUFLASH_NVRTC_OPTIONS="-DCUFLASH_DECODE_STALE=$st" timeout 60 python3 tools/decode_trace.py \
            "$tmp/decode_stale${st}_$run.json" --variants api > "$tmp/decode_stale${st}_$run.log" 2>&1
        echo "decode stale=$st run $run rc=$?"
    done
done
python3 - "$tmp" <<'PY'
import glob, json, sys
from collections import defaultdict
r = defaultdict(lambda: defaultdict(list))
for f in sorted(glob.glob(sys.argv[1] + "/fwd_*_*.json")):
    variant = f.rsplit("/", 1)[1].split("_")[1]
    for row in json.load(open(f)):
        r[(row["d"], row["n"], row["causal"], row["tile"])][variant].append(row["vs_cudnn"])
for k in sorted(r, key=str):
    print("FWD", *k, " ".join(f"{s}: " + "/".join(f"{x:.3f}" for x in r[k][s]) for s in sorted(r[k])))
d = defaultdict(lambda: defaultdict(list))
for f in sorted(glob.glob(sys.argv[1] + "/decode_stale*_*.json")):
    st = f.rsplit("/", 1)[1].split("_")[1]
    for row in json.load(open(f)):
        if "x_cudnn" in row:
            d[(row["L"], row["B"], row["hkv"])][st].append(row["x_cudnn"])
for k in sorted(d):
    print("DECODE", *k, " ".join(f"{s}: " + "/".join(f"{x:.3f}" for x in d[k][s]) for s in sorted(d[k])))
PY
CUFLASH_NVRTC_OPTIONS="-DCUFLASH_FWD_STALE_MIN_D=192 -DCUFLASH_DECODE_STALE=1" timeout 200 python3 -m pytest -q -m gpu -n 4 \
    tests/test_gpu_hopper_tma.py tests/test_gpu_decode.py tests/test_decode_cluster.py -p no:cacheprovider -rfE \
    > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -8
tar czf "$OUT/raw.tgz" -C "$tmp" .
