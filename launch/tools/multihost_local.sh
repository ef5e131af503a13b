#!/usr/bin/env bash
# Runs launch/train.py as N_PROC jax.distributed processes on this host.
#
#   launch/tools/multihost_local.sh N_PROC DEVICES_PER_PROC [train.py args...]
#   launch/tools/multihost_local.sh 2 4 train.steps=5 train.out_dir=runs/mh
#
# Process i gets --coordinator 127.0.0.1:PORT --num-processes N_PROC --process-id i and
# train.cpu_devices=DEVICES_PER_PROC, so N_PROC x DEVICES_PER_PROC simulated CPU devices form one
# global mesh: the code paths of a multi-host GPU job, on a laptop. JAX_PLATFORMS defaults to cpu
# (set JAX_PLATFORMS=cuda and CUDA_VISIBLE_DEVICES per process yourself to split local GPUs).
# PORT: $DISTCA_COORDINATOR_PORT, else a free one. Process 0's output goes to stdout (Gloo's
# connection messages to process_0.log); the others' to $DISTCA_LOG_DIR/process_<i>.log (default:
# a temporary directory, printed).
# SIGTERM / SIGINT (Ctrl-C) are passed to every process: they stop after the same step, save a
# checkpoint and exit 128 + the signal's number. If a process fails, the others are stopped
# (SIGTERM, then SIGKILL after $DISTCA_KILL_GRACE_S seconds, default 10: a survivor waiting in a
# collective for the dead peer cannot reach a step boundary). Exits with the first non-zero
# status of a process, 0 if all succeeded.
set -uo pipefail

if [[ $# -lt 2 ]]; then
  sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
N_PROC=$1
DEVICES=$2
shift 2
LAUNCH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
GRACE="${DISTCA_KILL_GRACE_S:-10}"
PORT="${DISTCA_COORDINATOR_PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
LOG_DIR="${DISTCA_LOG_DIR:-$(mktemp -d -t distca_multihost.XXXXXX)}"
mkdir -p "$LOG_DIR"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export PYTHONUNBUFFERED="${PYTHONUNBUFFERED:-1}"  # process 0 prints through a pipe (below)
echo "multihost_local: $N_PROC processes x $DEVICES devices, coordinator 127.0.0.1:$PORT, logs in $LOG_DIR" >&2

route_gloo() {  # stdin to stdout, but lines from Gloo to the file $1; deaf to the trainers' signals
  trap '' INT TERM
  local line
  while IFS= read -r line || [[ -n "$line" ]]; do
    if [[ "$line" == "[Gloo]"* ]]; then printf '%s\n' "$line" >>"$1"; else printf '%s\n' "$line"; fi
  done
}

# Each process in a process group of its own (setsid): a Ctrl-C in the terminal reaches only this
# script, which passes it on once; a process that got it twice would stop at once, unsaved.
pids=()
for ((i = 0; i < N_PROC; i++)); do
  args=(--coordinator "127.0.0.1:$PORT" --num-processes "$N_PROC" --process-id "$i" "$@" "train.cpu_devices=$DEVICES")
  if [[ $i -eq 0 ]]; then
    # Gloo's connection messages (printed by every process at its first collectives) go to
    # process_0.log instead of the terminal; stdbuf makes the C++ side write whole lines.
    setsid stdbuf -oL "$PYTHON" "$LAUNCH/train.py" "${args[@]}" > >(route_gloo "$LOG_DIR/process_0.log") &
  else
    # Only process 0 draws the progress bar and prints; the others log to files.
    setsid "$PYTHON" "$LAUNCH/train.py" "${args[@]}" train.progress=false >"$LOG_DIR/process_$i.log" 2>&1 &
  fi
  pids+=($!)
done

alive() {
  local pid
  for pid in "${pids[@]}"; do
    [[ -n "${done_pids[$pid]:-}" ]] || ! kill -0 "$pid" 2>/dev/null || return 0
  done
  return 1
}

forward() {  # a signal to every process still running
  local pid
  for pid in "${pids[@]}"; do
    [[ -n "${done_pids[$pid]:-}" ]] || kill -s "$1" "$pid" 2>/dev/null || true
  done
}

stop_the_rest() {  # SIGTERM now, SIGKILL to whoever is left after the grace period
  forward TERM
  ( sleep "$GRACE"; for pid in "${pids[@]}"; do kill -s KILL "$pid" 2>/dev/null || true; done ) &
  killer=$!
}

killer=""
trap 'echo "multihost_local: SIGTERM: passed to every process" >&2; forward TERM' TERM
trap 'echo "multihost_local: SIGINT: passed to every process" >&2; forward INT' INT

status=0
declare -A done_pids=()
# Wait for every process. `wait -n` also returns when a trapped signal arrives (with no process
# finished): the loop then waits on.
while alive; do
  finished=""
  if wait -n -p finished "${pids[@]}" 2>/dev/null; then rc=0; else rc=$?; fi
  [[ -n "${finished:-}" && -z "${done_pids[${finished:-}]:-}" ]] || continue
  done_pids[$finished]=1
  [[ $rc -eq 0 || $status -ne 0 ]] || status=$rc
  # 130 / 143: stopped by SIGINT / SIGTERM at a step boundary every process agreed on; the others
  # follow by themselves. Any other failure (an error, a SIGKILL) leaves them waiting for it.
  if [[ $rc -ne 0 && $rc -ne 130 && $rc -ne 143 && -z "$killer" ]]; then
    echo "multihost_local: process with pid $finished failed (exit $rc); stopping the others" >&2
    stop_the_rest
  fi
done
[[ -z "$killer" ]] || kill "$killer" 2>/dev/null || true
if [[ -n "$killer" ]]; then  # a process failed: show what the others said
  for ((i = 1; i < N_PROC; i++)); do
    echo "---- process $i (tail of $LOG_DIR/process_$i.log) ----" >&2
    tail -n 20 "$LOG_DIR/process_$i.log" >&2 || true
  done
fi
exit $status
