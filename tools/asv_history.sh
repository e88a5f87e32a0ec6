#!/usr/bin/env bash
# Record asv history runs on a GPU machine, without a network: this checkout's commit and,
# optionally, earlier commits, each timed with its own package tree and HEAD's suites.
#
#   OUT=dir bash tools/asv_history.sh HEAD_SHA [OLD_SHA ...]   (older commits oldest first; HEAD runs last)
#
# Run it in a throwaway copy of the repository: older commits' cuflash/ and cuda_src/ replace
# the checkout's in place while they are timed (asv's benchmark processes may put the
# repository root on sys.path, so PYTHONPATH alone could time HEAD's code under an old hash).
# Needs:
#   asv 0.6 importable (`pip install --no-index --find-links <wheels> asv` where there is no index)
#   .asvrepo/            a bare clone holding every commit named (asv reads commit dates from it)
#   .asvtrees/<sha>/     cuflash/ and cuda_src/ of each older commit (tools/asv_trees.sh makes both)
# Environment:
#   ASV_MACHINE    machine name (default: h100 or h200 from nvidia-smi)
#   ASV_DEADLINE   seconds after which no further commit is started (default 540)
#   ASV_FULL=1     this checkout's commit runs every suite, not only the history set
#   ASV_HEAD=0     only the older commits (backfill)
# What each commit runs: the HISTORY regexes (older commits: their time_ benchmarks) of benchmarks/benchmarks/bench_attention.py, with
# asv's samples kept (--record-samples) for tools/asv_regressions.py. Results are copied to
# $OUT/asv_results.tar (benchmarks/results/asv/) after every commit.
set -u
: "${OUT:?set OUT to the output folder}"
root=$(cd "$(dirname "$0")/.." && pwd)
start=$(date +%s)
head_sha=$1
machine=${ASV_MACHINE:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h100|h200' | tr 'A-Z' 'a-z')}
machine=${machine:-gpu}
cd "$root/benchmarks" || exit 2
sed "s#\"repo\": \"..\"#\"repo\": \"$root/.asvrepo\"#" asv.conf.json > asv.device.json
export PYTHONPATH="$root" PYTHONUNBUFFERED=1
python3 -m asv machine --config asv.device.json --machine "$machine" --yes > /dev/null || exit 2
mapfile -t history < <(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_attention as b; print('\n'.join(b.HISTORY))")
bench_args=()
for r in "${history[@]}"; do bench_args+=(--bench "$r"); done

# Older trees: compile their kernels side by side first (CuPy's disk cache keeps them).
for sha in "${@:2}"; do
    [ -d "$root/.asvtrees/$sha" ] || { echo "no .asvtrees/$sha" >&2; exit 2; }
    (cd "$root/tools" && PYTHONPATH="$root/.asvtrees/$sha" timeout 300 python3 asv_warm.py 2>&1 | tail -3 | sed "s#^#[$sha] #") &
done
wait
echo "== warm-up done at $(( $(date +%s) - start ))s"

head_save=$(mktemp -d)
cp -r "$root/cuflash" "$root/cuda_src" "$head_save/"
rc=0
commits=("${@:2}")
[ "${ASV_HEAD:-1}" = 1 ] && commits+=("$head_sha")
for sha in "${commits[@]}"; do  # oldest first, this checkout last
    elapsed=$(( $(date +%s) - start ))
    if [ "$elapsed" -gt "${ASV_DEADLINE:-540}" ]; then
        echo "== asv: $sha not started (${elapsed}s > ASV_DEADLINE)"; rc=1; continue
    fi
    args=("${bench_args[@]}")
    if [ "$sha" != "$head_sha" ]; then
        # Older commits: times only (peak bytes are recorded from this checkout on; each
        # benchmark is a process, and the start of one costs about a second).
        args=("${args[@]//|track_peak/}")
        rm -rf "$root/cuflash" "$root/cuda_src"
        cp -r "$root/.asvtrees/$sha/cuflash" "$root/.asvtrees/$sha/cuda_src" "$root/"
    elif [ "${ASV_FULL:-0}" = 1 ]; then
        args=()
    fi
    echo "== asv: $sha at ${elapsed}s"
    python3 -m asv run --config asv.device.json -E "existing:$(command -v python3)" --machine "$machine" \
        --set-commit-hash "$sha" --record-samples --launch-method forkserver "${args[@]}" 2>&1 | grep -E "failed|Error|^·" | tail -8
    rm -rf "$root/cuflash" "$root/cuda_src"
    cp -r "$head_save/cuflash" "$head_save/cuda_src" "$root/"
    tar -cf "$OUT/asv_results.tar" -C "$root/benchmarks" results/asv
done
rm -f asv.device.json
echo "== asv history: $(( $(date +%s) - start ))s"
exit "$rc"
