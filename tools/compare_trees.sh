#!/usr/bin/env bash
# One GPU run, two source trees: the benchmark grid of this tree's cuflash against another tree's
# (a baseline commit), each through its own benchmarks/peers.py with cuDNN timed beside it in the
# same process, alternating trees for PASSES passes. Writes $OUT/compare.json (every row of every
# pass), compare.txt (the table below) and runs.tar.gz (each run's JSON and log); prints, per cell, the new/old time ratio (median over passes) and cuDNN's drift
# between the two trees' processes; cells where the new tree is slower by more than LIMIT.
#
#   git archive <base> cuflash cuda_src benchmarks | tar -x -C .baseline   # on the build machine
#   OUT=dir BASE=.baseline bash tools/compare_trees.sh                    # on the GPU machine
#
# Environment: OUT (required), BASE (required: the baseline tree), PASSES (default 2),
# OPS (default "fwd bwd decode"), D (default 64,128,256), N (default 1024,2048,4096,8192,16384),
# SECONDS_PER_IMPL (default 0.3), LIMIT (default 1.02), PASS_START (the first pass's number, default 1).
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT to the output folder}"
: "${BASE:?set BASE to the baseline tree}"
mkdir -p "$OUT"
BASE=$(cd "$BASE" && pwd)
work=$(mktemp -d)  # per-run JSON and logs, packed into $OUT/runs.tar.gz at the end
trap 'rm -rf "$work"' EXIT
export PYTHONUNBUFFERED=1
passes=${PASSES:-2}
common=(--impls cuflash,torch-cudnn --seconds-per-impl "${SECONDS_PER_IMPL:-0.3}" --repeats 50)
grid=(--d "${D:-64,128,256}" --n "${N:-1024,2048,4096,8192,16384}")
rc=0
for pass in $(seq "${PASS_START:-1}" $(( ${PASS_START:-1} + passes - 1 ))); do
    for tree in new old; do
        if [ "$tree" = new ]; then root=$PWD; else root=$BASE; fi
        for op in ${OPS:-fwd bwd decode}; do  # (space separated)
            if [ "$op" = decode ]; then run=(--ops decode "${common[@]}"); else run=(--ops "$op" "${common[@]}" "${grid[@]}"); fi
            (cd "$root" && PYTHONPATH="$root" timeout "${STEP_TIMEOUT:-300}" python3 benchmarks/peers.py "${run[@]}" \
                --out "$work/$tree-$op-$pass.json") > "$work/$tree-$op-$pass.log" 2>&1
            r=$?; echo "pass $pass $tree $op rc=$r"; [ "$r" -ne 0 ] && rc=1
        done
    done
done
tar -czf "$OUT/runs.tar.gz" -C "$work" .
python3 - "$work" "$OUT" "${LIMIT:-1.02}" <<'PY' | tee "$OUT/compare.txt"
import json, pathlib, statistics, sys
work, out, limit = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), float(sys.argv[3])
rows = []
for f in sorted(work.glob("*-*-*.json")):
    tree, op, p = f.stem.split("-")
    for r in json.loads(f.read_text()).get("bench", []):
        rows.append(dict(r, tree=tree, pass_=int(p)))
(out / "compare.json").write_text(json.dumps(rows, indent=1))
key = lambda r: (r["op"], r["dtype"], r["d"], r["b"], r["hq"], r["hkv"], r["nq"], r["nk"], bool(r["causal"]))
cells = {}
for r in rows:
    if r.get("ms"):
        cells.setdefault(key(r), {}).setdefault((r["tree"], r["impl"]), []).append(r["ms"])
worst, slower = 0.0, []
print(f"{'cell':58s} new/old  cudnn drift")
for k, c in sorted(cells.items()):
    if ("new", "cuflash") not in c or ("old", "cuflash") not in c:
        print(f"{str(k):58s} incomplete")
        continue
    ratio = statistics.median(c[("new", "cuflash")]) / statistics.median(c[("old", "cuflash")])
    drift = (statistics.median(c[("new", "torch-cudnn")]) / statistics.median(c[("old", "torch-cudnn")])
             if ("new", "torch-cudnn") in c and ("old", "torch-cudnn") in c else float("nan"))
    worst = max(worst, ratio)
    if ratio > limit:
        slower.append(k)
    print(f"{str(k):58s} {ratio:7.4f}  {drift:7.4f}")
print(f"cells: {len(cells)}, worst new/old time {worst:.4f}, slower than {limit}: {len(slower)}")
PY
exit "$rc"
