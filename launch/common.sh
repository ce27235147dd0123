#!/usr/bin/env bash
# The body of every launcher (launch/<recipe>.sh sources it and calls launch_main). The same script
# runs unchanged on every node: the node whose address is MASTER_ADDR is the head, the others join.
#
# Head:   check the recipe and layout with the planner (nothing starts if it is invalid)
#         -> ray start --head (this node's devices) -> wait for NNODES (+ ROLLOUT_NNODES) nodes (JOIN_TIMEOUT_S)
#         -> ray job submit --no-wait --runtime-env <generated> -- python -m recipe.main_<algo> ...
#         -> ray job logs --follow, exit with the job's status -> stop this node's Ray.
#         A comparison (launch_compare) submits one job per variant (python -m recipe.compare
#         ... --variants <v>), one after another, then writes the report on the head.
# Worker: check the recipe -> join the head with retries (JOIN_TIMEOUT_S) -> stay until the head's
#         cluster ends -> stop this node's Ray.
# Only what this launcher started is stopped (its own `ray start`, its own job), on success, on
# errors and on SIGINT (Ctrl-C, exit 130) or SIGTERM (143) at any moment; a second signal does not
# cut the clean-up short. Logs: $LOG_DIR/<recipe>-<time>-<role>-<host>/. See docs/launch.md.

launch_usage() {
  cat <<EOF
usage: [VAR=value ...] bash $0 [--dry-run] [key.sub=value ...]

Runs ${LAUNCH_VARIANTS:+the comparison of $LAUNCH_VARIANTS on }${LAUNCH_ALGO:+$LAUNCH_ALGO on }the recipe ${RECIPE:-$LAUNCH_RECIPE}; run the same command on every node.
  --dry-run       print the layout, memory per device, environment and each node's commands; start nothing
  key.sub=value   recipe overrides, passed to the job (after the variables below)

Environment (empty: the recipe's or layout's own value):
  NNODES, NPUS_PER_NODE   cluster shape (default: the layout's trainer.nnodes / n_gpus_per_node)
  ROLLOUT_NNODES, ROLLOUT_NPUS_PER_NODE   the rollout on nodes of its own, besides NNODES (both or neither;
                          default: colocated on the training devices); runs async_training.mode=one_step_off
  MASTER_ADDR             the head node's address, the same on every node (default 127.0.0.1: one node)
  SOCKET_IFNAME           network interface for HCCL/gloo (default: the one on the route to MASTER_ADDR)
  MODEL_PATH, TRAIN_FILE, VAL_FILE, CKPT_DIR    checkpoint, data (comma-separated for several), run dir
  PARALLEL                a configs/parallel/*.yaml (path or name): swaps the parallel layout
  RAY_PORT (6379), DASHBOARD_PORT (8265), DASHBOARD_AGENT_PORT (52365), JOIN_TIMEOUT_S (600), LOG_DIR (./logs)
  NODE_IPS                all nodes' addresses, comma-separated: names the missing ones on a time-out
  MAX_RESTARTS (0)        resubmit a FAILED job up to this many times, once every node is back (JOIN_TIMEOUT_S);
                          the run resumes from its last complete checkpoint
  HCCL_BUFFSIZE           MB; default: the planner's value for the layout (NPU with MC2)
  RECIPE, RUNTIME_ENV     another recipe YAML / runtime env template (default configs/runtime_env/<by device>)
  NODE_ROLE, NODE_IP      head|worker and this node's address, when auto-detection is wrong
  RAY_AUTH_MODE (token)   Ray's token auth; every node needs the head's ~/.ray/auth_token or RAY_AUTH_TOKEN
Comparison launchers only:
  VARIANTS (grpo,grpo_r2,gspo)  one job per variant (recipe.compare's names), then the report
  SEEDS (1)               comma-separated; each job runs its variant for every seed
  COMPARE_DIR             where the runs and report/ go (default runs/compare/<recipe>); shared storage
More, with the multi-node procedure: docs/launch.md
EOF
}

log() { printf '[launch %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

die() {
  local rc=$1
  shift
  printf '[launch %s] error: %s\n' "$(date +%H:%M:%S)" "$*" >&2
  exit "$rc"
}

# ---- node facts --------------------------------------------------------------------------------

resolve_ip() {  # an address or host name -> an IPv4 address; nothing if it does not resolve
  if [[ $1 =~ ^[0-9.]+$ ]]; then
    echo "$1"
  else
    timeout 10 getent ahostsv4 "$1" | awk '{print $1; exit}' || true
  fi
}

local_ips() { ip -o -4 addr show 2>/dev/null | awk '{split($4, a, "/"); print a[1]}'; }

is_local_ip() { [[ $1 == 127.* ]] || local_ips | grep -qxF "$1"; }

route_field() {  # route_field <ip> dev|src: the field of the route this node takes to <ip>
  ip -o route get "$1" 2>/dev/null | awk -v f="$2" '{for (i = 1; i < NF; i++) if ($i == f) {print $(i + 1); exit}}'
}

ifname_of_ip() { ip -o -4 addr show 2>/dev/null | awk -v ip="$1" '{split($4, a, "/"); if (a[1] == ip) {print $2; exit}}'; }

head_reachable() { timeout 3 bash -c "exec 3<>/dev/tcp/$MASTER_IP/$RAY_PORT" 2>/dev/null; }

# ---- this launcher's processes and signals --------------------------------------------------------
# Every process the launcher starts runs in the background with its pid recorded (spawn), so that
# clean-up (on_exit) stops exactly those: the current killable step, the job by its submission id,
# this node's Ray. Background children of a script ignore a terminal's Ctrl-C: only this shell acts
# on it, and nothing is cut short behind the clean-up's back.

RAY_PID=""
RAY_TREE=()      # this node's Ray's processes (pid:start-time) when last seen up (ray_alive)
RAY_ADDRESS_FILE=${RAY_TMPDIR:-${TMPDIR:-/tmp}}/ray/ray_current_cluster  # where `ray start` records its cluster
RAY_RECORD=""
CHILD_PID=""     # the current step, safe to kill: the checks, wait-nodes, following the job, the report, a retry's wait
PAUSE_PID=""     # pause_at's wait
SUBMIT_PID=""    # `ray job submit --no-wait` in flight: waited for, never killed
JOB_ID=""        # set from just before the submission until the job is known to have ended
HOLD=0           # 1 inside spawn: a signal is only recorded in HELD_SIGNAL until the pid is
HELD_SIGNAL=""
STOPPING=0       # 1 once clean-up runs: a signal is only logged, the clean-up goes on
STOP_SIGNAL=""   # the first INT or TERM caught: the exit status is 128 + its number
SIGNALS=0        # how many came

# spawn <var> <command...>: start the command in the background and store its pid in <var> as one
# step for the signal handler: bash runs a trap between any two commands, so a signal right after
# the fork would otherwise exit before the pid is recorded and the clean-up would miss the process.
# Once a signal came, nothing new starts (except the clean-up's own steps).
spawn() {
  local var=$1
  shift
  HOLD=1
  if [[ -z $HELD_SIGNAL ]]; then
    "$@" &
    printf -v "$var" %s "$!"
  fi
  HOLD=0
  [[ -z $HELD_SIGNAL ]] || stop_on "$HELD_SIGNAL"
}

# to_file <file> <command...>, tee_to <file> <command...>: the command with its output into <file>
# (tee_to: and onto this launcher's output), as one command for spawn. Their `exec` would give the
# command back the default SIGINT of this shell's start, so they ignore it again explicitly.
to_file() {
  local out=$1
  shift
  trap '' INT
  exec "$@" >"$out" 2>&1
}
tee_to() {
  local out=$1
  shift
  trap '' INT
  exec "$@" > >(tee -p -a "$out") 2>&1
}

# run_waiting <command...>: run in the background and wait, so that a signal is acted on at once
# (bash runs a trap only between commands, and `wait` is one a signal interrupts).
run_waiting() {
  spawn CHILD_PID "$@"
  wait_child
}
wait_child() {
  local rc=0
  wait "$CHILD_PID" || rc=$?
  CHILD_PID=""
  return "$rc"
}

# wait_child_while_ray_runs: wait_child, but this node's Ray exiting first ends the wait (and the
# child) with status 2: the nodes would wait for a head that is gone until the join timeout.
wait_child_while_ray_runs() {
  while kill -0 "$CHILD_PID" 2>/dev/null; do
    if ! ray_alive; then
      await_pid "$CHILD_PID" 0
      CHILD_PID=""
      return 2
    fi
    sleep 1 &
    wait $! # a signal interrupts `wait` (its trap runs at once), not `sleep`
  done
  wait_child
}

# await_pid <pid> <seconds>: wait for a child to exit, killing it after <seconds>. It polls, so that
# a signal during clean-up (only logged there) does not cut the wait short. It never waits for a
# child that is gone: a signal whose trap interrupts `wait` just as that child is reaped leaves bash
# believing it still runs (bash 5.2), and `wait` for it would block for ever.
await_pid() {
  local deadline=$((SECONDS + $2))
  while kill -0 "$1" 2>/dev/null && ((SECONDS < deadline)); do
    sleep 0.2
  done
  if kill -0 "$1" 2>/dev/null; then
    kill -KILL "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
  fi
}

# start_time <pid>: when the process started (clock ticks since boot; nothing if it is gone or a
# zombie), so that a pid the system reuses later is not taken for the process recorded under it.
start_time() {
  local stat fields
  { read -r stat <"/proc/$1/stat"; } 2>/dev/null || return 0
  read -ra fields <<<"${stat##*) }"
  [[ ${fields[0]} == Z ]] || echo "${fields[19]}"
}

# descendants <pid>: <pid>'s descendants, one pid:start-time a line.
descendants() {
  local pid start
  for pid in $(ps -e -o pid= -o ppid= | awk -v root="$1" '
      {kids[$2] = kids[$2] " " $1}
      END {n = split(kids[root], q, " "); for (i = 1; i <= n; i++) {print q[i]; m = split(kids[q[i]], k, " "); for (j = 1; j <= m; j++) q[++n] = k[j]}}'); do
    start=$(start_time "$pid")
    [[ -z $start ]] || echo "$pid:$start"
  done
}

# ray_alive: this node's Ray still runs. Its processes are noted each time (RAY_TREE): a `ray start`
# that is killed leaves them running, no longer its descendants, holding the node's ports.
ray_alive() {
  kill -0 "$RAY_PID" 2>/dev/null || return 1
  local tree
  tree=$(descendants "$RAY_PID")
  [[ -z $tree ]] || mapfile -t RAY_TREE <<<"$tree"
}

# signal_alive <signal> <pid:start-time...>: send <signal> to those that are still the same processes.
signal_alive() {
  local sig=$1 entry
  shift
  for entry; do
    [[ $(start_time "${entry%%:*}") != "${entry#*:}" ]] || kill "-$sig" "${entry%%:*}" 2>/dev/null || true
  done
}

# reap <seconds> <pid:start-time...>: wait for those processes to end; SIGKILL any left after <seconds>.
reap() {
  local deadline=$((SECONDS + $1)) entry left
  shift
  while :; do
    left=()
    for entry; do
      [[ $(start_time "${entry%%:*}") != "${entry#*:}" ]] || left+=("${entry%%:*}")
    done
    ((${#left[@]} && SECONDS < deadline)) || break
    sleep 0.5
  done
  ((${#left[@]} == 0)) && return 0
  log "killing ${#left[@]} process(es) of this node's Ray that outlived it: ${left[*]}"
  kill -KILL "${left[@]}" 2>/dev/null || true
}

# stop_pid <var>: stop the child whose pid <var> holds, if any (SIGTERM; SIGKILL after 30 s).
stop_pid() {
  local pid=${!1}
  [[ -n $pid ]] || return 0
  kill -TERM "$pid" 2>/dev/null || true
  await_pid "$pid" 30
  printf -v "$1" %s ""
}

# pause_at <point>: the testing hook (docs/launch.md, "Signals"). When the comma-separated
# LAUNCH_PAUSE_AT names <point>, say so and wait there for a signal: a test signals this exact
# moment instead of sleeping and hoping. Short waits: a signal that comes (and is only logged, in
# clean-up) before a wait begins ends the pause within a second.
pause_at() {
  [[ ,${LAUNCH_PAUSE_AT:-}, == *,"$1",* ]] || return 0
  local seen=$SIGNALS
  log "paused at $1 (LAUNCH_PAUSE_AT)"
  while ((SIGNALS == seen)); do
    spawn PAUSE_PID sleep 1
    wait "$PAUSE_PID" || true
  done
  stop_pid PAUSE_PID
}

on_signal() {  # the INT and TERM trap
  SIGNALS=$((SIGNALS + 1))
  if ((STOPPING)); then
    [[ -n $STOP_SIGNAL ]] || STOP_SIGNAL=$1
    log "caught SIG$1: already stopping; the clean-up goes on"
  elif ((HOLD)); then
    [[ -n $HELD_SIGNAL ]] || HELD_SIGNAL=$1
  else
    stop_on "$1"
  fi
}

stop_on() {
  STOP_SIGNAL=$1
  HELD_SIGNAL=""
  log "caught SIG$1: stopping what this launcher started"
  exit $((128 + $(kill -l "$1")))
}

on_exit() {
  local rc=$?
  STOPPING=1
  set +e  # clean up everything, whatever fails on the way
  stop_pid CHILD_PID
  stop_pid PAUSE_PID
  stop_job
  pause_at cleanup
  stop_ray_node
  [[ -n ${SCRATCH:-} ]] && rm -rf "$SCRATCH"
  [[ $DRY_RUN == 0 && -d ${RUN_LOG:-} ]] && log "logs: $RUN_LOG"
  [[ -z $STOP_SIGNAL ]] || rc=$((128 + $(kill -l "$STOP_SIGNAL")))
  exit "$rc"
}

# start_ray_node <log> <command...>: run `ray start --block` in the background and wait until it
# reports the node up. --block keeps the Ray processes children of that one process, so stopping
# it (SIGTERM) stops exactly this node's Ray and nothing else on the machine.
start_ray_node() {
  local out=$1
  shift
  RAY_TREE=()
  spawn RAY_PID to_file "$out" "$@"
  pause_at ray_starting
  local deadline=$((SECONDS + RAY_START_TIMEOUT_S))
  until grep -q "Ray runtime started" "$out"; do
    if ! kill -0 "$RAY_PID" 2>/dev/null; then
      RAY_PID=""
      return 1
    fi
    if ((SECONDS >= deadline)); then
      stop_ray_node
      return 1
    fi
    sleep 1
  done
  # Its record of the cluster (GCS address, our RAY_PORT) follows the start-up message.
  local i
  for ((i = 0; i < 20; i++)); do
    if [[ -f $RAY_ADDRESS_FILE && $(<"$RAY_ADDRESS_FILE") == *":$RAY_PORT" ]]; then
      RAY_RECORD=$(<"$RAY_ADDRESS_FILE")
      break
    fi
    sleep 0.5
  done
}

stop_ray_node() {
  [[ -n $RAY_PID ]] || return 0
  local tree=("${RAY_TREE[@]}")
  if kill -0 "$RAY_PID" 2>/dev/null; then
    log "stopping this node's Ray (pid $RAY_PID, started by this launcher)"
    mapfile -t tree < <(descendants "$RAY_PID")
    kill -TERM "$RAY_PID" 2>/dev/null || true
  elif ((${#tree[@]})); then
    log "this node's Ray (pid $RAY_PID) is gone: stopping the ${#tree[@]} process(es) it had started"
    signal_alive TERM "${tree[@]}"
  fi
  # Still there after a minute: kill that one process; its children die with it (Ray ties them to
  # their parent's life).
  await_pid "$RAY_PID" 60
  RAY_PID=""
  # Some of them take their time to notice (the dashboard agent, holding its port, for one), and
  # the next launch on this node would find the port taken: 10 s, then SIGKILL.
  reap 10 "${tree[@]}"
  # `ray start` recorded this cluster as the machine's current one (a later plain ray.init() would
  # try to join it); forget it if it is still our record, as `ray stop` would.
  if [[ -n $RAY_RECORD && -f $RAY_ADDRESS_FILE && $(<"$RAY_ADDRESS_FILE") == "$RAY_RECORD" ]]; then
    rm -f "$RAY_ADDRESS_FILE"
  fi
}

# stop_job: stop this launcher's job if it may exist. A submission in flight is waited for, not
# killed: a client killed mid-request leaves the server registering the job after `ray job stop`
# found nothing, and the job would start anyway.
stop_job() {
  [[ -n $JOB_ID ]] || return 0
  if [[ -n $SUBMIT_PID ]]; then
    log "waiting for the submission of job $JOB_ID to return, to stop the job"
    await_pid "$SUBMIT_PID" 120
    SUBMIT_PID=""
  fi
  log "stopping job $JOB_ID"
  local pid out=$RUN_LOG/job_stop.log
  spawn pid to_file "$out" ray job stop --log-style pretty --log-color false --address "$DASHBOARD_URL" "$JOB_ID"
  await_pid "$pid" 60
  log "job $JOB_ID: $(tail -n 1 "$out")"
  JOB_ID=""
}

# ---- main ----------------------------------------------------------------------------------------

# launch_compare <recipe> [--dry-run] [key=value ...]: launch_main for a comparison: one job per
# variant of $VARIANTS on one Ray cluster, then the report (docs/stability.md).
launch_compare() {
  LAUNCH_VARIANTS=${VARIANTS:-grpo,grpo_r2,gspo}
  launch_main "$1" "" "${@:2}"
}

# launch_main <recipe> <algo> [--dry-run] [key=value ...]
launch_main() {
  LAUNCH_RECIPE=$1
  LAUNCH_ALGO=$2
  shift 2
  set -euo pipefail
  DRY_RUN=0
  local overrides=() arg
  for arg in "$@"; do
    case $arg in
      --dry-run) DRY_RUN=1 ;;
      -h | --help) launch_usage; exit 0 ;;
      *=*) overrides+=("$arg") ;;
      *) die 2 "argument '$arg': expected key.sub=value (a recipe override), --dry-run or --help" ;;
    esac
  done

  RECIPE=${RECIPE:-$LAUNCH_RECIPE}
  NNODES=${NNODES:-}
  NPUS_PER_NODE=${NPUS_PER_NODE:-}
  ROLLOUT_NNODES=${ROLLOUT_NNODES:-}
  ROLLOUT_NPUS_PER_NODE=${ROLLOUT_NPUS_PER_NODE:-}
  MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
  SOCKET_IFNAME=${SOCKET_IFNAME:-}
  MODEL_PATH=${MODEL_PATH:-}
  TRAIN_FILE=${TRAIN_FILE:-}
  VAL_FILE=${VAL_FILE:-}
  PARALLEL=${PARALLEL:-}
  CKPT_DIR=${CKPT_DIR:-}
  RAY_PORT=${RAY_PORT:-6379}
  DASHBOARD_PORT=${DASHBOARD_PORT:-8265}
  DASHBOARD_AGENT_PORT=${DASHBOARD_AGENT_PORT:-52365}
  JOIN_TIMEOUT_S=${JOIN_TIMEOUT_S:-600}
  MAX_RESTARTS=${MAX_RESTARTS:-0}
  RAY_START_TIMEOUT_S=${RAY_START_TIMEOUT_S:-120}
  LOG_DIR=${LOG_DIR:-logs}
  NODE_IPS=${NODE_IPS:-}
  NODE_ROLE=${NODE_ROLE:-}
  NODE_IP=${NODE_IP:-}
  HCCL_BUFFSIZE=${HCCL_BUFFSIZE:-}
  RUNTIME_ENV=${RUNTIME_ENV:-}
  PYTHON=${PYTHON:-python}
  LAUNCH_VARIANTS=${LAUNCH_VARIANTS:-}
  SEEDS=${SEEDS:-1}
  COMPARE_DIR=$(realpath -m "${COMPARE_DIR:-runs/compare/$(basename "$RECIPE" .yaml)}")
  local name
  for name in RAY_PORT DASHBOARD_PORT DASHBOARD_AGENT_PORT JOIN_TIMEOUT_S RAY_START_TIMEOUT_S MAX_RESTARTS; do
    [[ ${!name} =~ ^[0-9]+$ ]] || die 2 "$name=${!name}: expected a whole number"
  done
  check_rollout_pool_variables
  command -v ray >/dev/null || die 2 "the 'ray' command is not on PATH: install the package (pip install -e .) in this environment"
  command -v ip >/dev/null || die 2 "the 'ip' command (iproute2) is needed to find this node's address and interface"

  # Ray's token auth, explicit on every node so that servers and clients agree.
  export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
  # Nothing to drain when this launcher stops its node: the job is over or being stopped.
  export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}
  # Every address below is explicit; a RAY_ADDRESS left in the shell must not redirect a command.
  unset RAY_ADDRESS

  MASTER_IP=$(resolve_ip "$MASTER_ADDR")
  [[ -n $MASTER_IP ]] || die 2 "MASTER_ADDR=$MASTER_ADDR: cannot resolve it to an IPv4 address"
  if [[ -z $NODE_ROLE ]]; then
    if is_local_ip "$MASTER_IP"; then NODE_ROLE="head"; else NODE_ROLE="worker"; fi
  fi
  [[ $NODE_ROLE == head || $NODE_ROLE == worker ]] || die 2 "NODE_ROLE=$NODE_ROLE: expected head or worker"

  local stamp
  stamp=$(date +%Y%m%d-%H%M%S)
  RUN_LOG=$(realpath -m "$LOG_DIR")/$(basename "$RECIPE" .yaml)-$stamp-$NODE_ROLE-$(hostname -s)
  if ((DRY_RUN)); then  # the prepared files go to a scratch folder: a dry run leaves nothing behind
    SCRATCH=$(mktemp -d)
    OUT_DIR=$SCRATCH
  else
    OUT_DIR=$RUN_LOG
    mkdir -p "$RUN_LOG"
    # The copies outlive a Ctrl-C and a reader that goes away (tee -p), so that the clean-up's
    # messages are written and this shell never dies of SIGPIPE halfway through it.
    exec > >(trap '' INT TERM; exec tee -p -a "$RUN_LOG/launcher.log") \
      2> >(trap '' INT TERM; exec tee -p -a "$RUN_LOG/launcher.log" >&2)
  fi
  trap on_exit EXIT
  trap 'on_signal INT' INT
  trap 'on_signal TERM' TERM
  # A signal ignored when a script starts cannot be trapped (bash): say so rather than seem deaf.
  for name in INT TERM; do
    [[ $(trap -p "$name") != "trap -- '' SIG$name" ]] ||
      log "note: SIG$name is ignored here (this launcher was started with it ignored, e.g. with & from a script)"
  done

  log "$NODE_ROLE node $(hostname -s); recipe ${RECIPE}; ${LAUNCH_VARIANTS:+variants $LAUNCH_VARIANTS, seeds $SEEDS, in $COMPARE_DIR}${LAUNCH_ALGO:+algo $LAUNCH_ALGO}"
  log "MASTER_ADDR=$MASTER_ADDR RAY_PORT=$RAY_PORT DASHBOARD_PORT=$DASHBOARD_PORT JOIN_TIMEOUT_S=$JOIN_TIMEOUT_S LOG_DIR=$LOG_DIR PARALLEL=${PARALLEL:-(from the recipe)}"

  # 1. The recipe and layout, checked exactly as the job will load them, before anything starts.
  local status=0 dry=()
  ((DRY_RUN)) && dry=(--dry-run)
  run_waiting "$PYTHON" -m recipe.cluster prepare --recipe "$RECIPE" --algo "$LAUNCH_ALGO" --role "$NODE_ROLE" \
    --out-dir "$OUT_DIR" --nnodes "$NNODES" --devices-per-node "$NPUS_PER_NODE" --parallel "$PARALLEL" \
    --model-path "$MODEL_PATH" --train-file "$TRAIN_FILE" --val-file "$VAL_FILE" --ckpt-dir "$CKPT_DIR" \
    --hccl-buffsize "$HCCL_BUFFSIZE" --runtime-env "$RUNTIME_ENV" --rollout-nnodes "$ROLLOUT_NNODES" \
    --rollout-devices-per-node "$ROLLOUT_NPUS_PER_NODE" --head-ip "$MASTER_IP" --node-ips "$NODE_IPS" "${dry[@]}" \
    -- "${overrides[@]}" || status=$?
  ((status == 0)) || die "$status" "the checks above failed; nothing was started"
  # NNODES, NPUS_PER_NODE, ROLLOUT_NNODES, ROLLOUT_NPUS_PER_NODE, ALL_NODES (both pools), NODE_DEVICES (what
  # each node offers Ray), DEVICE, DEVICE_RESOURCE, RUN_DIR, EXPERIMENT, HCCL_BUFFSIZE_MB as resolved
  # shellcheck source=/dev/null
  source "$OUT_DIR/cluster.env"
  mapfile -t JOB_ARGS <"$OUT_DIR/job_args"

  if ((ALL_NODES > 1)) && [[ $MASTER_IP == 127.* ]]; then
    die 2 "NNODES=$NNODES${ROLLOUT_NNODES:+ + ROLLOUT_NNODES=$ROLLOUT_NNODES} but MASTER_ADDR=$MASTER_ADDR is a loopback address: set MASTER_ADDR to the head node's address, the same on every node"
  fi
  if [[ -z $NODE_IP ]]; then
    if [[ $NODE_ROLE == head ]]; then NODE_IP=$MASTER_IP; else NODE_IP=$(route_field "$MASTER_IP" src); fi
  fi
  if [[ -z $SOCKET_IFNAME ]]; then
    SOCKET_IFNAME=$(ifname_of_ip "$NODE_IP")
    [[ -n $SOCKET_IFNAME ]] || SOCKET_IFNAME=$(route_field "$MASTER_IP" dev)
  fi
  [[ -n $NODE_IP && -n $SOCKET_IFNAME ]] || die 2 "cannot find this node's address and interface on the route to $MASTER_IP: set NODE_IP and SOCKET_IFNAME"
  # Per node (interface names differ between nodes): exported before `ray start`, so every Ray
  # worker of this node inherits them.
  for name in HCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME TP_SOCKET_IFNAME NCCL_SOCKET_IFNAME; do
    export "$name=${!name:-$SOCKET_IFNAME}"
  done

  local resources=()
  case $DEVICE in
    npu) resources=(--resources "{\"NPU\": $NODE_DEVICES}") ;;
    cuda) resources=(--num-gpus "$NODE_DEVICES") ;;
    *) resources=(--num-cpus "$(( $(nproc) > NODE_DEVICES ? $(nproc) : NODE_DEVICES ))") ;;
  esac
  DASHBOARD_URL=http://127.0.0.1:$DASHBOARD_PORT
  # The commands, built once: the dry run prints them, the real run runs them.
  JOB_NAME="moe-rl-${EXPERIMENT//[^A-Za-z0-9_.-]/_}-$stamp-$$"
  local head_ip=$MASTER_IP  # what the head's command says, also in a worker's dry run
  [[ $NODE_ROLE == head ]] && head_ip=$NODE_IP
  HEAD_CMD=(ray start --head --block --port "$RAY_PORT" --node-ip-address "$head_ip"
    --dashboard-port "$DASHBOARD_PORT" --dashboard-agent-listen-port "$DASHBOARD_AGENT_PORT"
    --disable-usage-stats "${resources[@]}")
  WAIT_CMD=("$PYTHON" -m recipe.cluster wait-nodes --dashboard "$DASHBOARD_URL" --address "$MASTER_IP:$RAY_PORT"
    --expect "$ALL_NODES" --timeout "$JOIN_TIMEOUT_S" --resource "$DEVICE_RESOURCE" --per-node "$NODE_DEVICES"
    --node-ips "$NODE_IPS")
  # A comparison's report, on the head once every variant's job is done (its runs are finished, so
  # recipe.compare only writes the report).
  REPORT_CMD=("$PYTHON" -m recipe.compare "${JOB_ARGS[@]}" --variants "$LAUNCH_VARIANTS" --seeds "$SEEDS" --out "$COMPARE_DIR")
  WORKER_BASE=(ray start --address "$MASTER_IP:$RAY_PORT" --block --dashboard-agent-listen-port "$DASHBOARD_AGENT_PORT"
    --disable-usage-stats "${resources[@]}")
  WORKER_CMD=("${WORKER_BASE[@]}" --node-ip-address "$NODE_IP")

  if ((DRY_RUN)); then
    dry_run_report
    return 0
  fi
  log "this node: $NODE_IP on $SOCKET_IFNAME; cluster: $(cluster_shape)"
  check_auth_token
  pause_at before_ray
  if [[ $NODE_ROLE == head ]]; then
    run_head
  else
    run_worker
  fi
}

# ROLLOUT_NNODES and ROLLOUT_NPUS_PER_NODE: both whole numbers >= 1, or both empty (colocated).
check_rollout_pool_variables() {
  local name
  if [[ -n $ROLLOUT_NNODES && -z $ROLLOUT_NPUS_PER_NODE ]] || [[ -z $ROLLOUT_NNODES && -n $ROLLOUT_NPUS_PER_NODE ]]; then
    die 2 "ROLLOUT_NNODES=$ROLLOUT_NNODES ROLLOUT_NPUS_PER_NODE=$ROLLOUT_NPUS_PER_NODE: set both (the rollout's own nodes and devices per node), or neither for a rollout on the training devices"
  fi
  for name in ROLLOUT_NNODES ROLLOUT_NPUS_PER_NODE; do
    [[ -z ${!name} || ${!name} =~ ^[1-9][0-9]*$ ]] || die 2 "$name=${!name}: expected a whole number >= 1 (or leave it empty: no rollout pool of its own)"
  done
}

# cluster_shape: the nodes and devices of the pools, for the messages.
cluster_shape() {
  echo "$NNODES node(s) x $NPUS_PER_NODE $DEVICE${ROLLOUT_NNODES:+ training, $ROLLOUT_NNODES node(s) x $ROLLOUT_NPUS_PER_NODE $DEVICE rollout}"
}

check_auth_token() {
  [[ $RAY_AUTH_MODE == token ]] || return 0
  local file=${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}
  if [[ -z ${RAY_AUTH_TOKEN:-} && ! -s $file ]]; then
    if [[ $NODE_ROLE == head ]]; then
      ray get-auth-token --generate >/dev/null
      log "generated Ray's auth token in $file: give it to every worker node (same file, or RAY_AUTH_TOKEN)"
    else
      die 2 "Ray token auth is on and this node has no token: copy the head's ~/.ray/auth_token here or set RAY_AUTH_TOKEN (or RAY_AUTH_MODE=disabled on every node of a trusted network)"
    fi
  fi
  # The token is the cluster's password (Ray writes it readable by all): its owner's alone.
  if [[ -s $file && $(stat -c %a "$file") != 600 ]]; then
    chmod 600 "$file" && log "made $file readable by its owner only (it is the Ray cluster's password)"
  fi
}

# quote_cmd <command...>: the command as one line a shell reads back the same (single quotes
# only where an argument needs them).
quote_cmd() {
  local arg out=()
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
      out+=("$arg")
    else
      out+=("'${arg//\'/\'\\\'\'}'")
    fi
  done
  echo "${out[*]}"
}

dry_run_report() {
  local name
  echo
  echo "== dry run: nothing was started =="
  echo "this node: $NODE_ROLE ($NODE_IP on $SOCKET_IFNAME); cluster: $(cluster_shape)"
  echo "environment of every Ray process on this node (exported before ray start):"
  for name in RAY_AUTH_MODE RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S HCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME TP_SOCKET_IFNAME NCCL_SOCKET_IFNAME; do
    echo "  export $name=${!name}"
  done
  echo "runtime env of the job (every worker):"
  sed 's/^/  /' "$OUT_DIR/runtime_env.yaml"
  echo "head node ($MASTER_IP) runs:"
  printf '  %s\n' "$(quote_cmd "${HEAD_CMD[@]}")" "$(quote_cmd "${WAIT_CMD[@]}")"
  local job
  for job in $(jobs_to_submit); do
    submit_cmd "$job"
    printf '  %s\n' "$(quote_cmd "${SUBMIT_CMD[@]}")"
  done
  [[ -n $LAUNCH_VARIANTS ]] && printf '  %s\n' "$(quote_cmd "${REPORT_CMD[@]}")"
  if ((ALL_NODES > 1)); then
    echo "each of the $((ALL_NODES - 1)) worker node(s) runs${ROLLOUT_NNODES:+ (training and rollout nodes alike; the pools above say which is which)}:"
    # From the head, a worker's address is unknown: it is the worker's own on the route to the head.
    local worker_ip=$NODE_IP
    [[ $NODE_ROLE == head ]] && worker_ip="<its address on the route to $MASTER_IP>"
    printf '  %s\n' "$(quote_cmd "${WORKER_BASE[@]}" --node-ip-address "$worker_ip")"
  fi
  ((MAX_RESTARTS == 0)) || echo "a FAILED job is resubmitted up to $MAX_RESTARTS time(s) (MAX_RESTARTS), once all $ALL_NODES node(s) are back"
  echo "then the head stops its Ray when the job ends; the workers stop theirs when the head is gone."
  if [[ $NODE_ROLE == worker ]]; then
    if head_reachable; then
      echo "the head $MASTER_IP:$RAY_PORT answers"
    else
      echo "the head $MASTER_IP:$RAY_PORT does not answer (yet): start the launcher there, or check MASTER_ADDR, RAY_PORT and the firewall"
    fi
  fi
}

# The jobs a head submits: "main" (the recipe's entry), or a comparison's variants.
jobs_to_submit() {
  if [[ -n $LAUNCH_VARIANTS ]]; then echo "${LAUNCH_VARIANTS//,/ }"; else echo main; fi
}

# submit_cmd <job> [restart]: SUBMIT_CMD and SUBMIT_ID for "main" or one comparison variant. Ray runs the
# entrypoint with `sh -c`; `exec` makes the job that shell's own process, so that `ray job stop`
# signals the job itself (a shell that forks it and is stopped right at the start leaves it running).
submit_cmd() {
  local entry=(exec "$PYTHON" -m "recipe.main_$LAUNCH_ALGO" "${JOB_ARGS[@]}")
  SUBMIT_ID=$JOB_NAME
  if [[ $1 != main ]]; then
    entry=(exec "$PYTHON" -m recipe.compare "${JOB_ARGS[@]}" --variants "$1" --seeds "$SEEDS" --out "$COMPARE_DIR")
    SUBMIT_ID=$JOB_NAME-$1
  fi
  ((${2:-0} == 0)) || SUBMIT_ID=$SUBMIT_ID-restart$2
  SUBMIT_CMD=(ray job submit --no-wait --address "$DASHBOARD_URL" --submission-id "$SUBMIT_ID"
    --runtime-env "$RUN_LOG/runtime_env.yaml" -- "${entry[@]}")
}

# A port something else on this node listens on (another Ray, most often) fails late and unclearly:
# the dashboard agent's leaves the job API without an agent ("No available agent to submit job").
check_ports_free() {
  local name
  for name in RAY_PORT DASHBOARD_PORT DASHBOARD_AGENT_PORT; do
    [[ -z $(ss -Hltn "sport = :${!name}" 2>/dev/null) ]] ||
      die 1 "port ${!name} ($name) is in use on this node (another Ray?): set $name to a free port; nothing was started"
  done
}

run_head() {
  check_ports_free
  log "starting Ray head on $NODE_IP:$RAY_PORT ($NODE_DEVICES $DEVICE)"
  start_ray_node "$RUN_LOG/ray_head.log" "${HEAD_CMD[@]}" ||
    die 1 "ray start --head failed (log $RUN_LOG/ray_head.log): $(tail -n 3 "$RUN_LOG/ray_head.log" | tr '\n' ' ')"
  log "waiting up to ${JOIN_TIMEOUT_S}s for $ALL_NODES node(s)"
  spawn CHILD_PID "${WAIT_CMD[@]}"
  pause_at joining
  local rc=0
  wait_child_while_ray_runs || rc=$?
  ((rc != 2)) || die 1 "this node's Ray exited while it waited for the nodes; nothing was submitted (log $RUN_LOG/ray_head.log): $(tail -n 3 "$RUN_LOG/ray_head.log" | tr '\n' ' ')"
  ((rc == 0)) || die 1 "not all nodes joined; nothing was submitted"
  local job
  for job in $(jobs_to_submit); do
    run_job "$job"
  done
  if [[ -n $LAUNCH_VARIANTS ]]; then
    log "writing the comparison report: ${REPORT_CMD[*]}"
    run_waiting "${REPORT_CMD[@]}" || die 1 "the comparison report failed (its message is above)"
  fi
}

# run_job <job>: submit it (--no-wait: returns once the job is registered), follow its output to its
# end; a FAILED job is resubmitted up to MAX_RESTARTS times once every node is back (a lost node's
# launcher, restarted by the scheduler, joins again); fail unless it SUCCEEDED in the end.
run_job() {
  local restarts=0 rc
  while :; do
    rc=0
    submit_and_follow "$1" "$restarts" || rc=$?
    ((rc == 0)) && return 0
    if ((rc != 1 || restarts >= MAX_RESTARTS)); then
      die 1 "job $SUBMIT_ID did not succeed ($JOB_STATUS; log $JOB_LOG)$( ((restarts == 0)) || echo "; resubmitted $restarts time(s), MAX_RESTARTS=$MAX_RESTARTS")"
    fi
    restarts=$((restarts + 1))
    log "restart $restarts of $MAX_RESTARTS: waiting up to ${JOIN_TIMEOUT_S}s for $ALL_NODES node(s), then resubmitting (the run resumes from its last complete checkpoint)"
    spawn CHILD_PID "${WAIT_CMD[@]}"
    wait_child || die 1 "not all nodes are back; job $SUBMIT_ID was not resubmitted"
  done
}

# submit_and_follow <job> <restart>: one submission of the job (a restart's id ends in -restart<N>),
# followed to its end. Returns 0 if it SUCCEEDED, 1 if it FAILED (it may be resubmitted), 2 if it
# ended otherwise (stopped from outside: not resubmitted); JOB_STATUS and JOB_LOG say how.
submit_and_follow() {
  submit_cmd "$1" "$2"
  local job_log=$RUN_LOG/job${LAUNCH_VARIANTS:+-$1}.log rc=0 job_status
  (($2 == 0)) || job_log=$RUN_LOG/job${LAUNCH_VARIANTS:+-$1}-restart$2.log
  JOB_LOG=$job_log
  log "submitting job $SUBMIT_ID: ${SUBMIT_CMD[*]:11}"
  JOB_ID=$SUBMIT_ID
  spawn SUBMIT_PID to_file "$job_log" "${SUBMIT_CMD[@]}"
  pause_at submitting
  wait "$SUBMIT_PID" || rc=$?
  SUBMIT_PID=""
  ((rc == 0)) || die 1 "ray job submit failed (log $job_log): $(tail -n 1 "$job_log")"
  spawn CHILD_PID tee_to "$job_log" ray job logs --follow --address "$DASHBOARD_URL" "$SUBMIT_ID"
  pause_at job_running
  wait_child || true
  job_status=$("$PYTHON" -m recipe.cluster job-status --dashboard "$DASHBOARD_URL" --id "$SUBMIT_ID" 2>&1 | tail -n 1) || true
  case $job_status in SUCCEEDED | FAILED | STOPPED) JOB_ID="" ;; esac
  log "job $SUBMIT_ID: $job_status; run directory: ${LAUNCH_VARIANTS:+$COMPARE_DIR/$1}${LAUNCH_VARIANTS:-$RUN_DIR}"
  JOB_STATUS=$job_status
  case $job_status in SUCCEEDED) return 0 ;; FAILED) return 1 ;; *) return 2 ;; esac
}

run_worker() {
  local deadline=$((SECONDS + JOIN_TIMEOUT_S)) attempt=0 reason
  while :; do
    attempt=$((attempt + 1))
    if head_reachable; then
      if start_ray_node "$RUN_LOG/ray_worker.log" "${WORKER_CMD[@]}"; then
        break
      fi
      reason="ray start failed: $(tail -n 2 "$RUN_LOG/ray_worker.log" | tr '\n' ' ')"
    else
      reason="the head $MASTER_IP:$RAY_PORT does not answer"
    fi
    ((SECONDS < deadline)) || die 1 "could not join the Ray head at $MASTER_IP:$RAY_PORT within ${JOIN_TIMEOUT_S}s ($attempt attempts; last: $reason). Start the launcher on the head ($MASTER_ADDR) too, and check RAY_PORT and the firewall"
    log "attempt $attempt: $reason; retrying ($((deadline - SECONDS))s left)"
    pause_at joining
    run_waiting sleep 5
  done
  log "joined the Ray cluster at $MASTER_IP:$RAY_PORT as $NODE_IP; staying until the head's job ends"
  local misses=0
  while :; do
    ray_alive || die 1 "this node's Ray exited unexpectedly (log $RUN_LOG/ray_worker.log)"
    if head_reachable; then misses=0; else misses=$((misses + 1)); fi
    if ((misses >= 3)); then
      log "the head $MASTER_IP:$RAY_PORT is gone (its job ended or it stopped)"
      return 0
    fi
    run_waiting sleep 5
  done
}
