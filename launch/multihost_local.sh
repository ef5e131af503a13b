#!/usr/bin/env bash
# Runs launch/train.py as N_PROC jax.distributed processes on this host.
#
#   launch/multihost_local.sh N_PROC DEVICES_PER_PROC [train.py args...]
#   launch/multihost_local.sh 2 4 train.steps=5 train.out_dir=runs/mh
#
# Process i gets --coordinator 127.0.0.1:PORT --num-processes N_PROC --process-id i and
# train.cpu_devices=DEVICES_PER_PROC, so N_PROC x DEVICES_PER_PROC simulated CPU devices form one
# global mesh: the code paths of a multi-host GPU job, on a laptop. JAX_PLATFORMS defaults to cpu
# (set JAX_PLATFORMS=cuda and CUDA_VISIBLE_DEVICES per process yourself to split local GPUs).
# PORT: $DISTCA_COORDINATOR_PORT, else a free one. Process 0's output goes to stdout; the others'
# to $OUT_DIR/process_<i>.log ($DISTCA_LOG_DIR, default: a temporary directory, printed). If any
# process fails, the others are stopped and the script exits with the first failure's status.
set -euo pipefail

if [[ $# -lt 2 ]]; then
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
N_PROC=$1
DEVICES=$2
shift 2
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
PORT="${DISTCA_COORDINATOR_PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
LOG_DIR="${DISTCA_LOG_DIR:-$(mktemp -d -t distca_multihost.XXXXXX)}"
mkdir -p "$LOG_DIR"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
echo "multihost_local: $N_PROC processes x $DEVICES devices, coordinator 127.0.0.1:$PORT, logs in $LOG_DIR" >&2

pids=()
for ((i = 0; i < N_PROC; i++)); do
  args=(--coordinator "127.0.0.1:$PORT" --num-processes "$N_PROC" --process-id "$i" "$@" "train.cpu_devices=$DEVICES")
  if [[ $i -eq 0 ]]; then
    "$PYTHON" "$HERE/train.py" "${args[@]}" &
  else
    # Only process 0 draws the progress bar; the others log to files.
    "$PYTHON" "$HERE/train.py" "${args[@]}" train.progress=false >"$LOG_DIR/process_$i.log" 2>&1 &
  fi
  pids+=($!)
done

cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup INT TERM

status=0
remaining=${#pids[@]}
declare -A done_pids=()
# Wait for every process; on the first failure stop the rest (a missing peer would otherwise
# leave them blocked in a collective until the distributed timeout).
while [[ $remaining -gt 0 ]]; do
  if wait -n -p finished "${pids[@]}" 2>/dev/null; then rc=0; else rc=$?; fi
  [[ -n "${finished:-}" ]] || break
  [[ -z "${done_pids[$finished]:-}" ]] || continue
  done_pids[$finished]=1
  remaining=$((remaining - 1))
  if [[ $rc -ne 0 && $status -eq 0 ]]; then
    status=$rc
    echo "multihost_local: process with pid $finished failed (exit $rc); stopping the others" >&2
    cleanup
  fi
done
if [[ $status -ne 0 ]]; then
  for ((i = 1; i < N_PROC; i++)); do
    echo "---- process $i (tail of $LOG_DIR/process_$i.log) ----" >&2
    tail -n 20 "$LOG_DIR/process_$i.log" >&2 || true
  done
fi
exit $status
