#!/bin/bash
# Same-machine A/B of benchmarks/overhead.py between this tree and an older revision: the old
# tree's tracer/, export/ and benchmarks/ are unpacked from git into ab_old/ (untracked and not
# ignored, so a copy of the working tree to another machine carries it), then the two trees run in turn,
# ROUNDS times each (new, old, new, old, ...), each run a fresh process. Only the table rows are
# printed, each labelled with its tree and round; the full reports land in OUT_DIR.
#
#   bash benchmarks/ab_trees.sh 0d7ea4c 2 out/ab -- --device cuda --suite --suite-models llama \
#       --repeats 3 --no-first-step --configs plain,fast,check_numerics
set -euo pipefail
if [ $# -lt 4 ] || [ "$4" != "--" ]; then
    echo "usage: bash benchmarks/ab_trees.sh OLD_REV ROUNDS OUT_DIR -- OVERHEAD_ARGS..." >&2
    exit 2
fi
old_rev=$1 rounds=$2 out=$3
shift 4
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ ! -d ab_old ]; then
    mkdir ab_old
    git archive "$old_rev" tracer export benchmarks | tar -x -C ab_old
fi
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
    for tree in new old; do
        if [ "$tree" = new ]; then dir=$root; else dir=$root/ab_old; fi
        report=$out/$tree-$round.md
        PYTHONPATH=$dir python "$dir/benchmarks/overhead.py" "$@" --out "$report" > "$out/$tree-$round.log" 2>&1 \
            || echo "$tree round $round failed: see $out/$tree-$round.log"
        # the rows of every table: "| configuration | median ms | ..." and the model headers
        grep -h '^### \|^| [a-zA-Z]' "$report" 2>/dev/null | grep -v '^| configuration\|^| target' \
            | sed "s/^/$tree $round  /" || true
    done
done
