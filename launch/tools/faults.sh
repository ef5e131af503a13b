#!/usr/bin/env bash
# Replays the training run's longer fault scenarios on CPU and prints a table: case, expected,
# observed, ok. Minutes, not for CI (the quick versions live in tests/test_checkpoint.py and
# tests/test_resume.py).
#
#   launch/tools/faults.sh [WORK_DIR]        # default: a new temporary directory (kept)
#   FAULTS="damaged inputs" launch/tools/faults.sh   # only some groups: kill signals multihost
#                                                    # damaged inputs (default: all)
#
# Cases: kill -9 while a checkpoint is being written (three times, at different moments), then
# resume; SIGTERM and SIGINT to one process; SIGTERM to a two-process job (launch/tools/
# multihost_local.sh) and to one of its processes; a bit flipped in, a truncation of, and a lost
# commit marker of the newest checkpoint, then resume (skipped, moved aside, saved again); a run
# of another model shape refused into a run's directory (which must stay byte-identical); and two
# bad inputs (a GPU-only exchange on CPU, a coordinator without a port). Every resumed run's
# losses are compared with an uninterrupted run's. Exits 1 if any case is not ok.
# PYTHON: the interpreter (default: python).
set -uo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'
  exit 0
fi
LAUNCH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
WORK="${1:-$(mktemp -d -t distca_faults.XXXXXX)}"
mkdir -p "$WORK"
export JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1
unset XLA_FLAGS
# A one-layer model on 4 CPU devices, a checkpoint every 2 steps: each run compiles in seconds
# (the compile cache is shared by all runs).
TINY=(model.layers=1 model.hidden=64 model.ffn=128 model.vocab_size=256 model.dtype=float32
      model.remat=none data.tokens_per_device=256 data.length_scale=16 data.seed=4
      train.progress=false train.tensorboard=false train.imbalance_after=false
      attention.gate=false attention.min_imbalance=1.0 mesh.data=4 checkpoint.every=2
      checkpoint.keep=5 "train.compile_cache_dir=$WORK/cache")
STEPS=12
GROUPS_WANTED="${FAULTS:-kill signals multihost damaged inputs}"
ROWS=()
FAILED=0

want() { [[ " $GROUPS_WANTED " == *" $1 "* ]]; }

wait_for_step() {  # log, pid: until the log shows step 3 (0), or the process ended first (1)
  until grep -q '^step 3:' "$1" 2>/dev/null; do
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.2
  done
}

row() {  # case, expected, observed, ok (0/1)
  ROWS+=("$1|$2|$3|$([[ $4 == 1 ]] && echo ok || echo FAIL)")
  [[ $4 == 1 ]] || FAILED=1
  printf 'faults: %-28s %s\n' "$1" "$([[ $4 == 1 ]] && echo ok || echo FAIL: "$3")" >&2
}

train() {  # out_dir, extra args...: runs launch/train.py on 4 CPU devices; output in out_dir.log
  local out=$1
  shift
  "$PYTHON" "$LAUNCH/train.py" "${TINY[@]}" train.cpu_devices=4 "train.out_dir=$out" "$@" \
    >"$out.log" 2>&1
}

train_bg() {  # as train, in the background: PID is the trainer's own process id (to signal it)
  local out=$1
  shift
  "$PYTHON" "$LAUNCH/train.py" "${TINY[@]}" train.cpu_devices=4 "train.out_dir=$out" "$@" \
    >"$out.log" 2>&1 &
  PID=$!
}

losses() {  # summary.json -> its losses, one line
  "$PYTHON" -c 'import json, sys; print(" ".join(f"{x:.6f}" for x in json.load(open(sys.argv[1]))["losses"]))' "$1"
}

tail_losses() {  # the baseline's losses from step $1 on
  local from=$1
  echo "$BASE_LOSSES" | tr ' ' '\n' | tail -n +"$((from + 1))" | paste -sd' '
}

start_step() {
  "$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["start_step"])' "$1"
}

snapshot() {  # a directory's files and their checksums, one line each
  (cd "$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum)
}

# -------------------------------------------------------------------------- the reference run
train "$WORK/base" "train.steps=$STEPS"
BASE_LOSSES=$(losses "$WORK/base/summary.json")
echo "faults: baseline losses $BASE_LOSSES" >&2

resumed_ok() {  # out_dir: resumes it to STEPS; 1 if its losses equal the baseline's from its start
  local out=$1
  train "$out" "train.steps=$STEPS" || { echo "rc $? on resume"; return; }
  local s
  s=$(start_step "$out/summary.json")
  if [[ "$(losses "$out/summary.json")" == "$(tail_losses "$s")" ]]; then
    echo "resumed from $s, losses equal"
  else
    echo "resumed from $s, losses DIFFER"
  fi
}

resume_row() {  # case, expected, out_dir: resumes out_dir (resumed_ok) and reports it as a row
  local obs
  obs=$(resumed_ok "$3")
  row "$1" "$2" "$obs" "$([[ $obs == *"losses equal" ]] && echo 1 || echo 0)"
}

# -------------------------------------------------------------------------- kill -9 mid-save
for attempt in 1 2 3; do
  want kill || break
  out="$WORK/kill$attempt"
  rm -rf "$out"
  train_bg "$out" "train.steps=$STEPS" checkpoint.every=1
  pid=$PID
  # Kill at once while a save is in progress (orbax's tmp directory) once 2 x attempt - 1 steps
  # are committed: the 2nd, 4th and 6th save.
  for _ in $(seq 3000); do
    committed=$(find "$out/checkpoints" -maxdepth 1 -regex '.*/[0-9]+' 2>/dev/null | wc -l)
    if [[ $committed -ge $((2 * attempt - 1)) ]] &&
       compgen -G "$out/checkpoints/*.orbax-checkpoint-tmp*" >/dev/null; then
      break
    fi
    sleep 0.05
  done
  kill -9 "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  resume_row "kill -9 during save #$attempt" "resumes, losses equal" "$out"
done

# -------------------------------------------------------------------------- signals
for sig in TERM INT; do
  want signals || break
  out="$WORK/sig$sig"
  rm -rf "$out"
  train_bg "$out" "train.steps=400"
  pid=$PID
  wait_for_step "$out.log" "$pid" && kill -s "$sig" "$pid"
  wait "$pid"
  rc=$?
  want=$([[ $sig == TERM ]] && echo 143 || echo 130)
  saved=$(grep -o 'checkpoint at step [0-9]*' "$out.log" | head -1)
  row "SIG$sig, one process" "rc $want, checkpoint at the step" "rc $rc, ${saved:-no checkpoint line}" \
    "$([[ $rc == "$want" && -n $saved ]] && echo 1 || echo 0)"
  resume_row "resume after SIG$sig" "losses equal" "$out"
done

for target in all one; do
  want multihost || break
  out="$WORK/mh_$target"
  rm -rf "$out" "$out.logs"
  mkdir -p "$out.logs"
  DISTCA_LOG_DIR="$out.logs" "$LAUNCH/tools/multihost_local.sh" 2 2 "${TINY[@]}" train.steps=400 \
    "train.out_dir=$out" >"$out.log" 2>&1 &
  pid=$!
  if ! wait_for_step "$out.log" "$pid"; then
    :  # ended before step 3 (e.g. Gloo's start-up timed out on a loaded machine): a failed row
  elif [[ $target == all ]]; then
    kill -TERM "$pid"
  else  # one trainer only: the other must stop after the same step
    kill -TERM "$(pgrep -f -- "--process-id 1 .*train.out_dir=$out" | head -1)"
  fi
  wait "$pid"
  rc=$?
  saved=$(grep -o 'checkpoint at step [0-9]*' "$out.log" | head -1)
  row "SIGTERM, 2 processes ($target)" "rc 143, checkpoint at the step" "rc $rc, ${saved:-no checkpoint line}" \
    "$([[ $rc == 143 && -n $saved ]] && echo 1 || echo 0)"
done

# -------------------------------------------------------------------------- damaged checkpoints
damage() {  # kind, checkpoint step dir
  case $1 in
    bitflip)
      "$PYTHON" - "$2" <<'EOF'
import pathlib, random, sys
files = sorted(p for p in pathlib.Path(sys.argv[1]).rglob("d/*") if p.is_file())
f = random.Random(1).choice(files)
raw = bytearray(f.read_bytes())
bit = random.Random(2).randrange(len(raw) * 8)
raw[bit // 8] ^= 1 << bit % 8
f.write_bytes(bytes(raw))
EOF
      ;;
    truncate) find "$2/state" -path '*/d/*' -type f -exec truncate -s 10 {} + ;;
    marker) rm -f "$2/commit_success.txt" ;;
  esac
}

for kind in bitflip truncate marker; do
  want damaged || break
  out="$WORK/damaged_$kind"
  rm -rf "$out"
  cp -r "$WORK/base" "$out"
  # The run as if stopped at step 8: its newest checkpoint damaged, four steps left to train.
  rm -rf "$out/checkpoints/10" "$out/checkpoints/12" "$out/summary.json"
  newest=8
  damage "$kind" "$out/checkpoints/$newest"
  train "$out" "train.steps=$STEPS"
  rc=$?
  s=$(start_step "$out/summary.json" 2>/dev/null || echo "?")
  healed=$([[ -f "$out/checkpoints/$newest/commit_success.txt" ]] && echo "step $newest saved again" || echo "step $newest missing")
  aside=$([[ -d "$out/checkpoints/$newest.aside" ]] && echo ", old one aside" || echo "")
  same=$([[ "$(losses "$out/summary.json" 2>/dev/null)" == "$(tail_losses "$s")" ]] && echo "losses equal" || echo "losses DIFFER")
  obs="rc $rc, resumed from $s; $healed$aside; $same"
  ok=0
  if [[ $rc == 0 && $same == "losses equal" && $healed == *"saved again" ]]; then
    # A flip the checksums prove harmless may resume the newest step itself.
    [[ $s != "$newest" || $kind == bitflip ]] && ok=1
  fi
  row "damaged newest: $kind" "falls back, heals, losses equal" "$obs" $ok
done

# -------------------------------------------------------------------------- refusals, inputs
if want inputs; then
out="$WORK/refused"
rm -rf "$out"
cp -r "$WORK/base" "$out"
before=$(snapshot "$out")
train "$out" "train.steps=$STEPS" model.hidden=128
rc=$?
after=$(snapshot "$out")
row "another model shape" "rc 2, directory unchanged" \
  "rc $rc, directory $([[ "$before" == "$after" ]] && echo unchanged || echo CHANGED)" \
  "$([[ $rc == 2 && "$before" == "$after" ]] && echo 1 || echo 0)"

out="$WORK/ragged"
train "$out" attention.impl=distca attention.exchange=ragged train.steps=1
rc=$?
row "ragged exchange on CPU" "rc 2, one config error line" "rc $rc, $(wc -l <"$out.log") line(s): $(head -c 80 "$out.log")" \
  "$([[ $rc == 2 && $(wc -l <"$out.log") == 1 ]] && echo 1 || echo 0)"

out="$WORK/coordinator"
train "$out" --coordinator notahost --num-processes 2 --process-id 0
rc=$?
row "coordinator without a port" "rc 3, one line" "rc $rc, $(head -c 80 "$out.log")" \
  "$([[ $rc == 3 && $(wc -l <"$out.log") == 1 ]] && echo 1 || echo 0)"
fi

# -------------------------------------------------------------------------- the table
echo
echo "| case | expected | observed | ok |"
echo "|---|---|---|---|"
for r in "${ROWS[@]}"; do
  IFS='|' read -r c e o k <<<"$r"
  echo "| $c | $e | $o | $k |"
done
echo
echo "work directory: $WORK"
exit $FAILED
