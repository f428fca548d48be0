#!/usr/bin/env bash
# Training across machines as a cluster user meets it (issue 39), each "machine" a network
# namespace with its own address and hostname, mpirun (in a namespace of its own) starting one
# rank per host through an rsh agent, TCP between the ranks. Two networks join the hosts: a
# kernel bridge, and a switch in user space that delays and drops frames (tests/netdelay.c: this
# kernel has no netem, tc or iptables):
#   - 2 and 3 hosts end with the weights of `mpirun -np 2` / `-np 3` on one machine, bit for bit,
#     also with 5 ms of one-way latency and 1% of frames lost;
#   - SIGTERM to mpirun: every rank stops with a checkpoint, and --resume ends with the weights
#     of a run never stopped, byte for byte;
#   - a cut link: the other rank stops within --timeout naming the lost one, writes its flight
#     recorder, `tandem doctor` names the lost rank, and mpirun exits. Open MPI's mpirun waits
#     for a lost host's daemon until TCP gives up (net.ipv4.tcp_retries2: 15.5 minutes by
#     default, bench/RESULTS.md "Issue 39"); the namespace mpirun runs in sets it to 3 (the
#     README gives cluster administrators 5: 18 s), so the job ends within seconds here.
# Exits 77 (skipped, with the reason) where namespaces cannot be made: not root, no `ip`, no
# veth or bridge support.
#   tests/multihost.sh TANDEM MPIRUN NETDELAY
# With BENCH=path/to/bench_mpi_allreduce it measures instead (bench/RESULTS.md, "Issue 39"):
# Tandem's all-reduce and an MLP epoch at 10 ms one-way, with the TCP sizes Tandem sets and with
# Open MPI's own.
set -uo pipefail
tandem=$(realpath "$1") mpirun=$2 netdelay=$(realpath "$3")
skip() { echo "multihost: skipped: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root (network namespaces)"
command -v ip >/dev/null || skip "no ip command (iproute2)"
id=$((RANDOM % 90 + 10)) net=10.213.$id slow=10.214.$id
ns() { echo "tdm${id}h$1"; }
work=$(mktemp -d /tmp/tandem_multihost_XXXXXX)
switch_pid=
cleanup() {
  pkill -9 -f "$work" 2>/dev/null
  [ -n "$switch_pid" ] && kill "$switch_pid" 2>/dev/null
  for i in 0 1 2 3 sw; do ip netns del "$(ns $i)" 2>/dev/null; done
  ip link del "tdmbr$id" 2>/dev/null
  [ "${keep:-0}" = 1 ] || rm -rf "$work"
}
trap cleanup EXIT
ip link add "tdmbr$id" type bridge 2>/dev/null || skip "cannot make a bridge"
ip link set "tdmbr$id" up
for i in 0 1 2 3; do # host 0 runs mpirun, 1..3 the ranks
  ip netns add "$(ns $i)" || skip "cannot make a network namespace"
  ip link add "tv${id}$i" type veth peer name eth0 netns "$(ns $i)" || skip "no veth"
  ip link set "tv${id}$i" master "tdmbr$id" up
  ip netns exec "$(ns $i)" ip addr add "$net.$((i + 1))/24" dev eth0
  ip netns exec "$(ns $i)" ip link set eth0 up
  ip netns exec "$(ns $i)" ip link set lo up
done
# the slow network: eth1 of each host on a port of netdelay's switch, in a namespace of its own
ip netns add "$(ns sw)" || skip "cannot make a network namespace"
ip netns exec "$(ns sw)" ip link set lo up
for i in 0 1 2 3; do
  ip link add "sp${id}$i" netns "$(ns sw)" type veth peer name eth1 netns "$(ns $i)" ||
    skip "no veth"
  ip netns exec "$(ns sw)" ip link set "sp${id}$i" up
  ip netns exec "$(ns $i)" ip addr add "$slow.$((i + 1))/24" dev eth1
  ip netns exec "$(ns $i)" ip link set eth1 up
done
switch() { # netdelay's options: the slow network's delay and loss from now on
  [ -n "$switch_pid" ] && kill "$switch_pid" && wait "$switch_pid"
  ip netns exec "$(ns sw)" "$netdelay" "$@" "sp${id}0" "sp${id}1" "sp${id}2" "sp${id}3" \
    >>"$work/netdelay.out" 2>&1 &
  switch_pid=$!
  sleep 0.2
  kill -0 $switch_pid || skip "netdelay cannot run: $(cat "$work/netdelay.out")"
}
ip netns exec "$(ns 0)" sysctl -qw net.ipv4.tcp_retries2=3 # README: 5 (18 s); 3 here, shorter
# the rsh agent: `rsh ADDRESS command...` runs the command on that host, named hostN
cat >"$work/rsh" <<EOF
#!/bin/bash
host=\$1; shift
n=\$((\${host##*.} - 1))
exec ip netns exec tdm${id}h\$n unshare --uts sh -c "hostname host\$n; \$*"
EOF
chmod +x "$work/rsh"
printf "%s slots=1\n" "$net.2" "$net.3" "$net.4" >"$work/hosts"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# one GEMM thread a rank on every host and on one machine alike: a GEMM's sums follow its
# threads, and a rank takes its share of its machine's cores (tdm_mpi_share_cores: every core
# alone on a host, 1 of 2 beside another) unless OMP_NUM_THREADS says otherwise
export OMP_NUM_THREADS=1
hosts() { # ranks, command...: over hosts 1..ranks, from host 0; NET=$slow: the slow network
  local np=$1 on=${NET:-$net}
  shift
  ip netns exec "$(ns 0)" "$mpirun" --hostfile "$work/hosts" -np "$np" \
    --mca plm_rsh_agent "$work/rsh" --mca btl self,tcp --mca btl_tcp_if_include "$on.0/24" \
    --mca oob_tcp_if_include "$on.0/24" -x OMP_NUM_THREADS "$@"
}
fail=0
bad() { echo "multihost: FAIL: $*"; fail=1; keep=1; }
last_model() { ls "$1"/ckpt-*/model.safetensors 2>/dev/null | tail -1; }
same_model() { # dir dir: their last checkpoints' weights are the same bytes
  local a b
  a=$(last_model "$1") b=$(last_model "$2")
  [ -n "$a" ] && [ -n "$b" ] && cmp -s "$a" "$b"
}
if [ -n "${BENCH:-}" ]; then # the latency figures: 10 ms one-way, Tandem's TCP sizes and Open MPI's
  switch --delay 10
  own=(--mca btl_tcp_eager_limit 65536 --mca btl_tcp_max_send_size 131072)
  for round in 1 2; do
    for sizes in tandem openmpi; do
      extra=()
      [ $sizes = openmpi ] && extra=("${own[@]}")
      echo "== round $round, TCP sizes: $sizes"
      NET=$slow hosts 2 "${extra[@]}" "$BENCH" 0.5 4 | grep -E "^ +(4096|65536|131072|1048576|4194304) "
      rm -rf "$work/epoch"
      NET=$slow hosts 2 "${extra[@]}" "$tandem" train --model mlp --limit 8192 --epochs 1 \
        --batch-size 128 --quiet --checkpoint-dir "$work/epoch" | grep "^epoch"
    done
  done
  exit 0
fi
run=(train --model mlp --limit 2048 --epochs 1 --batch-size 96 --quiet) # 96: over 2 and 3
for np in 2 3; do
  "$mpirun" --oversubscribe -x OMP_NUM_THREADS -np $np "$tandem" "${run[@]}" --checkpoint-dir "$work/one$np" \
    >"$work/one$np.out" 2>&1 || bad "one machine, $np processes: $(tail -3 "$work/one$np.out")"
  hosts $np "$tandem" "${run[@]}" --checkpoint-dir "$work/hosts$np" >"$work/hosts$np.out" 2>&1 ||
    bad "$np hosts: $(tail -5 "$work/hosts$np.out")"
  if same_model "$work/one$np" "$work/hosts$np"; then
    echo "multihost: $np hosts: the weights of $np processes on one machine, bit for bit"
  else
    bad "$np hosts: weights differ from one machine's"
  fi
done
# latency and loss: 5 ms one-way, 1% of frames dropped
switch --delay 5 --loss 1 --seed $id
NET=$slow hosts 2 "$tandem" "${run[@]}" --checkpoint-dir "$work/slow2" >"$work/slow2.out" 2>&1 ||
  bad "2 hosts, 5 ms and 1% loss: $(tail -5 "$work/slow2.out")"
if same_model "$work/one2" "$work/slow2"; then
  echo "multihost: 2 hosts at 5 ms one-way and 1% loss: the weights of one machine, bit for bit"
else
  bad "2 hosts at 5 ms and 1% loss: weights differ from one machine's"
fi
# SIGTERM to mpirun mid-run (Open MPI gives the ranks 1 s: the MLP's checkpoint fits), then
# --resume; over the slow network at 3 ms, so that the run lasts long enough to be stopped
long=(train --model mlp --limit 2048 --epochs 10 --batch-size 96 --quiet)
"$mpirun" --oversubscribe -np 2 "$tandem" "${long[@]}" --checkpoint-dir "$work/full" \
  >"$work/full.out" 2>&1 || bad "one machine, 10 epochs: $(tail -3 "$work/full.out")"
switch --delay 3
NET=$slow hosts 2 "$tandem" "${long[@]}" --checkpoint-dir "$work/term" >"$work/term.out" 2>&1 &
job=$!
for _ in $(seq 200); do grep -q "^epoch 2/" "$work/term.out" && break; sleep 0.05; done
pkill -TERM -f "^$mpirun .*$work/term" || bad "no mpirun to send SIGTERM to"
wait $job
status=$?
stopped=$(ls -d "$work/term"/ckpt-* 2>/dev/null)
[ $status = 1 ] || bad "SIGTERM to mpirun: exit $status, not 1 (Open MPI's)"
hosts 2 "$tandem" "${long[@]}" --checkpoint-dir "$work/term" --resume >>"$work/term.out" 2>&1 ||
  bad "--resume after SIGTERM: $(tail -5 "$work/term.out")"
final=$(dirname "$(last_model "$work/full")")
if [ "$(echo "$stopped" | wc -w)" = 1 ] && [ "${stopped##*/}" != "${final##*/}" ] &&
  same_model "$work/full" "$work/term"; then
  echo "multihost: SIGTERM to mpirun at ${stopped##*/}, then --resume: the weights of a run" \
    "never stopped"
else
  bad "SIGTERM and --resume: after the stop '${stopped//$work\//}' (one before ${final##*/}" \
    "expected), or the weights differ from a run never stopped"
fi
# a cut link: host 2 (rank 1) unreachable while both train
mkdir -p "$work/dbg"
start=$(date +%s.%N)
hosts 2 "$tandem" train --model mlp --epochs 100 --timeout 3 --quiet --debug-dir "$work/dbg" \
  >"$work/cut.out" 2>&1 &
job=$!
for _ in $(seq 100); do grep -q "^epoch 1/" "$work/cut.out" && break; sleep 0.1; done
ip link set "tv${id}2" down
cut=$(date +%s.%N)
for _ in $(seq 600); do kill -0 $job 2>/dev/null || break; sleep 0.1; done
if kill -0 $job 2>/dev/null; then
  bad "mpirun still running 60 s after the cut"
  kill -9 $job
fi
wait $job
ended=$(date +%s.%N)
echo "multihost: cut link: mpirun exited $(echo "$ended - $cut" | bc) s after the cut (--timeout 3)"
grep -q "timed out after 3.0 s waiting for rank 1" "$work/cut.out" ||
  bad "no rank named the lost one: $(grep -v '^epoch' "$work/cut.out" | head -5)"
[ -s "$work/dbg/flight-rank-0.jsonl" ] || bad "rank 0 wrote no flight recorder"
doc=$("$tandem" doctor "$work/dbg" 2>&1)
echo "$doc" | grep -q "late: rank 1, which rank 0 timed out waiting for" ||
  bad "tandem doctor did not name rank 1: $doc"
[ $fail = 0 ] && echo "multihost: passed (started $(echo "$cut - $start" | bc) s into the run)"
exit $fail
