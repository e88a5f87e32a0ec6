#!/usr/bin/env bash
# The d=128 forward tiles (table own pace, ping-pong, their persistent forms) as built and with the
# lane-0 warpgroup index everywhere (-DCUFLASH_FWD_UNIFORM_ALL=1), next to cuDNN in one call: does
# ping-pong's spacing of the two warpgroups' HGMMA issues let the uniform index pay off at d=128?
#   OUT=dir bash tools/uniform_pp_probe.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
tiles=128x128wg2s2T,128x128wg2s2PP,128x128wg2s2T-persist-wgepi,128x128wg2s2PP-persist-wgepi
for variant in base uniform; do
    opts=""; [ "$variant" = uniform ] && opts="-DCUFLASH_FWD_UNIFORM_ALL=1"
    CUFLASH_NVRTC_OPTIONS="$opts" timeout ${SWEEP_TIMEOUT:-110} python3 tools/hopper_fwd_sweep.py --d 128 --n ${SWEEP_N:-1024,4096,16384} \
        --tiles "$tiles" --json "$OUT/pp_${variant}.json" > "$OUT/pp_${variant}.log" 2>&1
    echo "== $variant rc=$?"; cat "$OUT/pp_${variant}.log"
done
