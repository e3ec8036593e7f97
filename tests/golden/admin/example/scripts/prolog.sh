#!/bin/bash
# Prolog for site "local" (site.toml), rendered by `slurm-dlrm admin render`.
# slurmd runs it as root when a job is allocated (PrologFlags=Alloc). For a gres/mps job it
# starts the MPS control daemon of the job's GPU (one daemon per GPU, shared by the gres/mps
# jobs on it) and records the job, so the epilog stops the daemon after its last job.
# A non-zero exit drains the node and requeues the job: we exit 1 only when MPS cannot start.
set -u
# MPS clients (the jobs' users) must be able to reach the pipe directories.
umask 022
# slurmd may run this with a bare environment; Slurm's and MPS's commands live here.
export PATH=${PATH:+$PATH:}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# [slurm] mps_control_command: the MPS control program (daemon with -d, client without).
MPS_CONTROL=nvidia-cuda-mps-control
# [slurm] mps_pipe_root: GPU <i> has its daemon's pipes in $PIPE_ROOT/gpu<i>/pipe.
PIPE_ROOT=/run/slurm-dlrm/mps
# [slurm] mps_log_root: GPU <i> logs to $LOG_ROOT/gpu<i>; events.log records starts/stops.
LOG_ROOT=/var/log/slurm-dlrm/mps
# [slurm] shm_dir: MPS leaves cuda.shm.* segments here.
SHM_DIR=/dev/shm
# One record per job that holds MPS on this node:
# "<GPU indices, comma-separated> <thread pct> <gpu_mem_mib, 0 = no fence>".
JOBS_DIR=$PIPE_ROOT/jobs

log() {
  mkdir -p "$LOG_ROOT" 2>/dev/null
  printf '%s %s job %s: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "${0##*/}" "${SLURM_JOB_ID:-?}" "$*" \
    >>"$LOG_ROOT/events.log" 2>/dev/null
  logger -t slurm-dlrm-mps -- "job ${SLURM_JOB_ID:-?}: $*" 2>/dev/null || true
}

# True while process $1 exists and is not a zombie (an exited daemon nobody reaped yet).
is_alive() {
  local stat
  kill -0 "$1" 2>/dev/null || return 1
  stat=$(<"/proc/$1/stat") 2>/dev/null || return 1
  stat=${stat##*) }
  [[ ${stat%% *} != Z ]]
}

gpu_dir() { printf '%s/gpu%s' "$PIPE_ROOT" "$1"; }
pipe_dir() { printf '%s/gpu%s/pipe' "$PIPE_ROOT" "$1"; }
log_dir() { printf '%s/gpu%s' "$LOG_ROOT" "$1"; }

# The PID of GPU $1's control daemon if it runs, else nothing. The daemon writes its PID
# into its pipe directory; the command-line check guards against a reused PID.
daemon_pid() {
  local pidfile pid cmdline
  pidfile="$(pipe_dir "$1")/nvidia-cuda-mps-control.pid"
  [[ -r $pidfile ]] || return 0
  pid=$(<"$pidfile") || return 0
  pid=${pid//[[:space:]]/}
  [[ $pid =~ ^[0-9]+$ ]] || return 0
  is_alive "$pid" || return 0
  cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 0
  [[ $cmdline == *"${MPS_CONTROL##*/}"* ]] || return 0
  printf '%s' "$pid"
}

# Send one command to GPU $1's daemon (a client call; bounded so a wedged daemon cannot hang us).
control() {
  local gpu=$1
  shift
  printf '%s\n' "$*" | CUDA_MPS_PIPE_DIRECTORY="$(pipe_dir "$gpu")" CUDA_MPS_LOG_DIRECTORY="$(log_dir "$gpu")" \
    timeout 5 "$MPS_CONTROL"
}

# True if GPU $1's daemon runs: its PID file names a live daemon, or (drivers that write no
# PID file) it answers get_server_list on its pipe.
daemon_up() {
  [[ -n $(daemon_pid "$1") ]] && return 0
  [[ -d $(pipe_dir "$1") ]] && control "$1" get_server_list >/dev/null 2>&1
}

any_daemon_running() {
  local d
  for d in "$PIPE_ROOT"/gpu*; do
    [[ -d $d ]] || continue
    daemon_up "${d##*/gpu}" && return 0
  done
  return 1
}

# Remove what a stopped or dead daemon of GPU $1 left: its pipes, and once no daemon runs on
# the node, the shared-memory segments (their names do not say which GPU they belong to).
clean_stale() {
  rm -rf -- "$(pipe_dir "$1")"
  if ! any_daemon_running; then
    rm -f -- "$SHM_DIR"/cuda.shm.*
  fi
}
# [slurm] mps_start_timeout_s, as a count of 0.1 s polls.
START_POLLS=100
# [mps] mps_per_gpu: --gres=mps:N of one GPU is N*100/MPS_PER_GPU percent of its SMs.
MPS_PER_GPU=100
# The --comment marker slurm-dlrm's submissions carry (docs/interfaces.md section 6).
MARKER_PREFIX=slurm-dlrm:
MODE_NO_PACK=no-pack

# The job as slurmctld has it, one line (read once per job and node; the task prolog
# only reads what we record, so tasks never ask the controller).
JOB_RECORD=
read_job_record() {
  JOB_RECORD=$(timeout 10 scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null) ||
    log "scontrol show job failed; no memory fence, Slurm's thread percentage"
}

# Thread percentage from the job's gres/mps count (fallback: what Slurm put in the env).
job_thread_pct() {
  # Slurm 22.05.8 with gres/shard configured too divides by the shard count (mps:50 gave 625).
  local tres count
  tres=$(grep -o 'TresPerNode=[^ ]*' <<<"$JOB_RECORD")
  if [[ $tres =~ mps(:[A-Za-z0-9_-]+)?:([0-9]+) ]]; then
    count=${BASH_REMATCH[2]}
    echo $(((count * 100 + MPS_PER_GPU - 1) / MPS_PER_GPU))
    return
  fi
  log "cannot read the gres/mps count from scontrol; using CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
  local pct=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
  [[ $pct =~ ^[0-9]+$ ]] || pct=100
  ((pct > 100)) && pct=100
  echo "$pct"
}

# The per-GPU memory a --no-pack job's --comment marker recorded (docs/interfaces.md
# section 6), else 0 (no fence: packs, whose agent fences each member, and other jobs).
job_gpu_mem_mib() {
  local comment field mode='' mib=0
  comment=$(grep -o "Comment=${MARKER_PREFIX}[^ ]*" <<<"$JOB_RECORD") || { echo 0; return; }
  IFS=, read -ra fields <<<"${comment#"Comment=$MARKER_PREFIX"}"
  for field in "${fields[@]}"; do
    case $field in
      mode=*) mode=${field#mode=} ;;
      gpu_mem_mib=*) mib=${field#gpu_mem_mib=} ;;
    esac
  done
  if [[ $mode == "$MODE_NO_PACK" && $mib =~ ^[1-9][0-9]{0,8}$ ]]; then
    echo "$mib"
  else
    echo 0
  fi
}

# Start GPU $1's daemon with default thread percentage $2 and wait, bounded, until it answers.
start_daemon() {
  local gpu=$1 pct=$2 pipe logs i
  pipe=$(pipe_dir "$gpu")
  logs=$(log_dir "$gpu")
  clean_stale "$gpu"
  mkdir -p "$pipe" "$logs" || return 1
  # The daemon must not inherit our lock (fd 9) or slurmd's pipes: it outlives this script.
  if ! CUDA_VISIBLE_DEVICES=$gpu CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$logs \
    "$MPS_CONTROL" -d </dev/null >>"$logs/start.log" 2>&1 9>&-; then
    log "GPU $gpu: $MPS_CONTROL -d failed (see $logs/start.log)"
    return 1
  fi
  for ((i = 0; i < START_POLLS; i++)); do
    if control "$gpu" get_server_list >/dev/null 2>&1; then
      local pid_text
      pid_text=$(daemon_pid "$gpu")
      pid_text=${pid_text:+$pid_text }
      # Clients carry the job's own percentage (Slurm sets it in the job's environment);
      # the default caps a client that lost it.
      control "$gpu" set_default_active_thread_percentage "$pct" >/dev/null 2>&1 ||
        log "GPU $gpu: set_default_active_thread_percentage $pct refused"
      log "GPU $gpu: MPS control daemon ${pid_text}started, default thread percentage $pct"
      return 0
    fi
    sleep 0.1
  done
  log "GPU $gpu: MPS control daemon did not answer get_server_list within $START_POLLS polls"
  return 1
}

main() {
  # Slurm sets both only for a gres/mps job (the indices are the node's, not the job's).
  [[ -n ${CUDA_MPS_ACTIVE_THREAD_PERCENTAGE:-} && -n ${CUDA_VISIBLE_DEVICES:-} ]] || return 0
  local job=${SLURM_JOB_ID:-} pct mem_mib gpu gpus
  [[ $job =~ ^[0-9]+$ ]] || { log "no SLURM_JOB_ID"; return 1; }
  IFS=, read -ra gpus <<<"$CUDA_VISIBLE_DEVICES"
  for gpu in "${gpus[@]}"; do
    [[ $gpu =~ ^[0-9]+$ ]] || { log "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES is not a list of indices"; return 1; }
  done
  read_job_record
  pct=$(job_thread_pct)
  mem_mib=$(job_gpu_mem_mib)
  mkdir -p "$PIPE_ROOT" "$JOBS_DIR" || return 1
  exec 9>"$PIPE_ROOT/lock"
  flock -w 60 9 || { log "lock $PIPE_ROOT/lock busy for 60 s"; return 1; }
  for gpu in "${gpus[@]}"; do
    mkdir -p "$(gpu_dir "$gpu")/jobs" && : >"$(gpu_dir "$gpu")/jobs/$job" || return 1
    if ! daemon_up "$gpu" && ! start_daemon "$gpu" "$pct"; then
      rm -f -- "$(gpu_dir "$gpu")/jobs/$job"
      return 1
    fi
  done
  # Read by the task prolog (as the job's user) and by the epilog.
  printf '%s %s %s\n' "$(IFS=,; echo "${gpus[*]}")" "$pct" "$mem_mib" >"$JOBS_DIR/.$job.tmp" &&
    chmod 0644 "$JOBS_DIR/.$job.tmp" && mv -f "$JOBS_DIR/.$job.tmp" "$JOBS_DIR/$job"
}

main
