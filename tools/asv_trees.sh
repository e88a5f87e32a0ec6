#!/usr/bin/env bash
# Prepare what tools/asv_history.sh reads on a machine without the repository's .git:
# .asvrepo (a bare clone: asv reads commit dates from it) and .asvtrees/<sha>/ (cuflash/ and
# cuda_src/ of each older commit). Both are ignored by git; pass them to the GPU machine.
#
#   bash tools/asv_trees.sh OLD_SHA [OLD_SHA ...]
set -eu
cd "$(dirname "$0")/.."
rm -rf .asvrepo .asvtrees
git clone -q --bare . .asvrepo
for sha in "$@"; do
    full=$(git rev-parse "$sha^{commit}")
    mkdir -p ".asvtrees/$full"
    git archive "$full" cuflash cuda_src | tar -x -C ".asvtrees/$full"
done
echo "$(ls .asvtrees | wc -l) trees, .asvrepo at $(git rev-parse --short HEAD)"
