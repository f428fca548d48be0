#!/bin/sh
# ZeRO stages against DDP on a GPT of 57 M parameters (and 113 M) on 2 MPI processes, one CPU
# device each: the allocator's peak per process over the epoch and the tokens per second, in
# interleaved rounds (this VM's speed drifts), medians printed. With TANDEM_BASE set to another
# build's tandem, each row runs with both binaries in turn, and both are printed (a change's
# effect, measured in one run). Usage:
#   [TANDEM_BASE=OLD/tandem] bench/zero_memory.sh TEXT_FILE [ROUNDS] [CONFIGS]
# (build/tandem built; Open MPI's mpirun). CONFIGS: rows "layers|shard|options", options'
# spaces written as _, separated by spaces or newlines (default: the rows of bench/RESULTS.md).
set -eu
text=${1:?usage: bench/zero_memory.sh TEXT_FILE [ROUNDS] [CONFIGS]}
rounds=${2:-3}
tandem=${TANDEM:-build/tandem}
binaries=$tandem${TANDEM_BASE:+ $TANDEM_BASE}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out=$(mktemp -d)
configs=${3:-"8|none| 8|gradients| 8|parameters| 8|parameters|--bucket-cap_4 8|none|--recompute
8|parameters|--recompute_--bucket-cap_4 16|none| 16|parameters|--bucket-cap_4"}
# A row "layers|shard|options" into $layers, $shard and $extra (the options, _ as spaces).
parse() {
    layers=${1%%|*}; rest=${1#*|}; shard=${rest%%|*}; extra=$(echo "${rest#*|}" | tr _ ' ')
}
for r in $(seq "$rounds"); do
    i=0
    for c in $configs; do
        i=$((i + 1))
        parse "$c"
        b=0
        for bin in $binaries; do
            b=$((b + 1))
            # shellcheck disable=SC2086
            mpirun -np 2 "$bin" train --model gpt --data "$text" --layers "$layers" --heads 12 \
                --channels 768 --context 64 --batch-size 4 --optimizer adamw --epochs 1 \
                --limit 40 --shard "$shard" $extra 2>&1 |
                sed -n 's/.*train loss \([0-9.]*\) .* \([0-9]*\) tok\/s .*peak \([0-9.]*\) MiB.*/\1 \2 \3/p' \
                    >>"$out/$i.$b"
        done
    done
done
printf '%-7s %-11s %-28s %10s %9s %11s%s\n' layers shard options "peak MiB" "tok/s" "train loss" \
    "${TANDEM_BASE:+  binary}"
i=0
for c in $configs; do
    i=$((i + 1))
    parse "$c"
    b=0
    for bin in $binaries; do
        b=$((b + 1))
        f=$out/$i.$b
        tok=$(cut -d' ' -f2 "$f" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
        peak=$(cut -d' ' -f3 "$f" | sort -n | tail -1)
        loss=$(cut -d' ' -f1 "$f" | head -1)
        printf '%-7s %-11s %-28s %10s %9s %11s%s\n' "$layers" "$shard" "${extra:--}" "$peak" \
            "$tok" "$loss" "${TANDEM_BASE:+  $bin}"
    done
done
rm -r "$out"
