#!/usr/bin/env bash
# One device call (about 5 minutes): does an L2 prefetch hint on the decode kernel's K/V reads
# (cp.async ... .L2::{64,128,256}B, CUFLASH_DECODE_L2_PREFETCH) close the last 1-3% to cuDNN?
# Each size runs in its own process (the macro is an NVRTC option) with cuDNN and FA2 timed in
# that same process, every cell of the peers' decode grid; then deeper rings with the best size.
#   OUT=dir bash tools/decode_l2_probe.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
for pf in ${PF_SIZES:-0 256 128}; do
    CUFLASH_NVRTC_OPTIONS="-DCUFLASH_DECODE_L2_PREFETCH=$pf" timeout 110 python3 tools/decode_probe.py \
        "$OUT/decode_pf$pf.json" --default-only 2>&1 | grep -v Warn > "$OUT/decode_pf$pf.log"
    echo "prefetch $pf rc=$?"; grep DECODE "$OUT/decode_pf$pf.log"
done
CUFLASH_NVRTC_OPTIONS="-DCUFLASH_DECODE_L2_PREFETCH=${RING_PF:-256}" DECODE_CANDS="${DECODE_CANDS:-16,4,3;16,4,4;32,4,3;16,8,3}" \
    timeout 150 python3 tools/decode_probe.py "$OUT/decode_many.json" --many-cells 2>&1 | grep -v Warn \
    | tee "$OUT/decode_many.log" | grep DECODE
