#!/bin/sh
# ZeRO stages against DDP on a GPT of 57 M parameters (and 113 M) on 2 MPI processes, one CPU
# device each: the allocator's peak per process over the epoch and the tokens per second, in
# interleaved rounds (this VM's speed drifts), medians printed. Usage:
#   bench/zero_memory.sh TEXT_FILE [ROUNDS]   (build/tandem built; Open MPI's mpirun)
set -eu
text=${1:?usage: bench/zero_memory.sh TEXT_FILE [ROUNDS]}
rounds=${2:-3}
tandem=${TANDEM:-build/tandem}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out=$(mktemp -d)
configs="8|none| 8|gradients| 8|parameters| 8|parameters|--bucket-cap_4 8|none|--recompute
8|parameters|--recompute_--bucket-cap_4 16|none| 16|parameters|--bucket-cap_4"
for r in $(seq "$rounds"); do
    i=0
    for c in $configs; do
        i=$((i + 1))
        layers=${c%%|*}; rest=${c#*|}; shard=${rest%%|*}; extra=$(echo "${rest#*|}" | tr _ ' ')
        # shellcheck disable=SC2086
        mpirun -np 2 "$tandem" train --model gpt --data "$text" --layers "$layers" --heads 12 \
            --channels 768 --context 64 --batch-size 4 --optimizer adamw --epochs 1 \
            --limit 40 --shard "$shard" $extra 2>&1 |
            sed -n 's/.*train loss \([0-9.]*\) .* \([0-9]*\) tok\/s .*peak \([0-9.]*\) MiB.*/\1 \2 \3/p' \
                >>"$out/$i"
    done
done
i=0
printf '%-7s %-11s %-28s %10s %9s %11s\n' layers shard options "peak MiB" "tok/s" "train loss"
for c in $configs; do
    i=$((i + 1))
    layers=${c%%|*}; rest=${c#*|}; shard=${rest%%|*}; extra=$(echo "${rest#*|}" | tr _ ' ')
    tok=$(cut -d' ' -f2 "$out/$i" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
    peak=$(cut -d' ' -f3 "$out/$i" | sort -n | tail -1)
    loss=$(cut -d' ' -f1 "$out/$i" | head -1)
    printf '%-7s %-11s %-28s %10s %9s %11s\n' "$layers" "$shard" "${extra:--}" "$peak" "$tok" "$loss"
done
rm -r "$out"
