#!/usr/bin/env bash
# Device probe: the non-persistent TMA forward with each math warpgroup storing its own O rows
# (HopperTile.wg_epilogue) against the table tile, A B A B in one process at d=128 and 256, next to
# cuDNN (tools/hopper_fwd_sweep.py; each candidate is checked against the float64 reference first).
#   OUT=dir bash tools/wgepi_probe.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
timeout "${SWEEP_TIMEOUT:-400}" python3 - "$OUT/wgepi_sweep.json" <<'PY' > "$OUT/wgepi_sweep.log" 2>&1
import dataclasses, sys
sys.path.insert(0, "tools")
import hopper_fwd_sweep as s
from cuflash import schedule
for d in (128, 256):
    a = schedule.HOPPER_FORWARD_TILES[d]
    b = dataclasses.replace(a, wg_epilogue=True, reason="")
    s.CANDIDATES[d] = [a, b, a, b]
sys.argv = ["hopper_fwd_sweep.py", "--d", "128,256", "--n", "1024,2048,4096,16384", "--json", sys.argv[1]]
s.main()
PY
echo "sweep rc=$?"; cat "$OUT/wgepi_sweep.log"
