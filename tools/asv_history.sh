#!/usr/bin/env bash
# asv history on a GPU machine for HEAD and earlier kernel commits, without a network.
# Run it in a throwaway copy of the repository: it swaps cuflash/ and cuda_src/ in place.
#
#   OUT=dir bash tools/asv_history.sh HEAD_SHA [OLD_SHA ...]
#
# Needs: asv importable (optionally from $ASV_SITE, kept off the global path), .asvrepo (a bare clone: asv reads commit dates from it),
# .asvtrees/<sha>/ (cuflash + cuda_src of each older commit, from `git archive`). Each commit is
# benchmarked in the current interpreter with its own package tree on PYTHONPATH and recorded
# under its hash (--set-commit-hash); results go to $OUT/asv_results.tar (benchmarks/results/asv/).
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/benchmarks" || exit 2
sed "s#\"repo\": \"..\"#\"repo\": \"$root/.asvrepo\"#" asv.conf.json > asv.device.json
PYTHONPATH="$root${ASV_SITE:+:$ASV_SITE}" python3 -m asv machine --config asv.device.json --machine h200 --yes > /dev/null
export CUFLASH_ASV_SMALL=${CUFLASH_ASV_SMALL:-1}
# Older commits replace the package in place: asv's
# benchmark processes may put the repository root on sys.path, so PYTHONPATH alone could measure
# HEAD's code under an old hash. HEAD's package is saved first and restored after each.
head_save=$(mktemp -d)
cp -r "$root/cuflash" "$root/cuda_src" "$head_save/"
for sha in "$@"; do
    tree="$root"
    if [ -d "$root/.asvtrees/$sha" ]; then
        rm -rf "$root/cuflash" "$root/cuda_src"
        cp -r "$root/.asvtrees/$sha/cuflash" "$root/.asvtrees/$sha/cuda_src" "$root/"
        tree="$root/.asvtrees/$sha"
    fi
    echo "== asv: $sha (package from $tree; cuflash/ now holds $(ls "$root/cuflash" | wc -l) files)"
    # HEAD keeps asv's samples; older commits are backfilled with one sample each (--quick).
    quick=""; [ "$tree" != "$root" ] && quick="--quick"
    PYTHONPATH="$root${ASV_SITE:+:$ASV_SITE}" timeout "${ASV_TIMEOUT:-150}" python3 -m asv run --config asv.device.json -E "existing:$(command -v python3)" \
        --machine h200 --set-commit-hash "$sha" --bench "${ASV_BENCH:-Forward}" --show-stderr $quick 2>&1 | tail -25
    rm -rf "$root/cuflash" "$root/cuda_src"
    cp -r "$head_save/cuflash" "$head_save/cuda_src" "$root/"
done
rm -f asv.device.json
tar -cf "$OUT/asv_results.tar" -C "$root/benchmarks" results/asv
