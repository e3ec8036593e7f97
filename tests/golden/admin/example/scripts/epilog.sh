#!/bin/bash
# Epilog for site "local" (site.toml), rendered by `slurm-dlrm admin render`.
# slurmd runs it as root when a job ends. For a job the prolog recorded it drops the job from
# its GPU; after a GPU's last job it stops that GPU's MPS control daemon with `quit`, waits
# (bounded) for it to exit, then cleans its pipes (and the node's shared memory once no
# daemon is left). A non-zero exit drains the node: only when a daemon cannot be stopped.
set -u
# The task prolog (the job's user) reads the job records; pipe folders are narrowed to the
# GPU's users by restrict_pipe.
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
# One record per job that holds MPS on this node: "<GPU indices, comma-separated>
# <thread pct> <gpu_mem_mib, 0 = no fence> <MPS protocol of its daemon: 2 or 3>".
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

# One field of job $1 as slurmctld has it: squeue's one-letter format $2 (b = TresPerNode,
# k = Comment, T = state) prints that field alone. Never grep `scontrol show job -o`: its
# one line puts the job name, work dir and submit line (the user's text) before Comment=
# and TresPerNode=, so a job named "x TresPerNode=mps:100" posed as its own request.
# Bounded, so a slow controller cannot hang slurmd.
job_field() {
  timeout 10 squeue --noheader --states=all --jobs="$1" --format="%$2"
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
  # Written by the daemon we started (as us), never by the user a pipe folder may belong to.
  [[ $(stat -c %u "$pidfile" 2>/dev/null) == "$(id -u)" ]] || return 0
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

# The MPS protocol of GPU $1's daemon (the prolog records it when it starts the daemon).
daemon_protocol() {
  local proto
  proto=$(<"$(gpu_dir "$1")/protocol") 2>/dev/null || proto=2
  [[ $proto == 3 ]] && echo 3 || echo 2
}

# One MPS v3 module verb command to GPU $1's daemon: v3 takes commands as arguments, not
# on stdin (NVIDIA MPS docs, "MPS v3 Interface").
control3() {
  local gpu=$1
  shift
  CUDA_MPS_PIPE_DIRECTORY="$(pipe_dir "$gpu")" CUDA_MPS_LOG_DIRECTORY="$(log_dir "$gpu")" \
    timeout 5 "$MPS_CONTROL" "$@" </dev/null
}

# True if GPU $1's daemon answers a harmless query in its protocol.
daemon_answers() {
  if [[ $(daemon_protocol "$1") == 3 ]]; then
    control3 "$1" server list >/dev/null 2>&1
  else
    control "$1" get_server_list >/dev/null 2>&1
  fi
}

# True if GPU $1's daemon runs: its PID file names a live daemon, or (drivers that write no
# PID file) it answers on its pipe.
daemon_up() {
  [[ -n $(daemon_pid "$1") ]] && return 0
  [[ -d $(pipe_dir "$1") ]] && daemon_answers "$1"
}

# True where ACLs can be set here (setfacl, from the acl package).
have_acl() { setfacl --version >/dev/null 2>&1; }

# GPU $1's pipe folder reachable by the users with jobs on that GPU only (their records in
# gpu<i>/jobs: "<uid> <MiB>"). Otherwise any process on the node could point
# CUDA_MPS_PIPE_DIRECTORY at another GPU's daemon, whose servers run outside the job's
# device cgroup. With ACLs the folder stays root's (mode 1700: the sticky bit keeps users
# from removing or replacing the daemon's socket and PID file) and each such user gets an
# entry; without, the first of them owns it (0700) and the others cannot reach it.
restrict_pipe() {
  local gpu=$1 pipe f u owner
  local -a uids=()
  pipe=$(pipe_dir "$gpu")
  [[ -d $pipe ]] || return 0
  for f in "$(gpu_dir "$gpu")"/jobs/*; do
    [[ -f $f ]] || continue
    read -r u _ <"$f" 2>/dev/null || continue
    [[ $u =~ ^[0-9]+$ ]] && uids+=("$u")
  done
  if have_acl; then
    chown "$(id -u):$(id -g)" "$pipe" && chmod 1700 "$pipe" || return 1
    local acl_ok=1
    setfacl -b "$pipe" 2>/dev/null || acl_ok=0
    for u in $(printf '%s\n' "${uids[@]}" | sort -un); do
      ((acl_ok)) && { setfacl -m "u:$u:rwx" "$pipe" 2>/dev/null || acl_ok=0; }
    done
    ((acl_ok)) && return 0
    # A filesystem without ACLs under mps_pipe_root: as if setfacl were missing.
    log "GPU $gpu: setfacl refused on $pipe (no ACL support there?); the folder goes to the GPU's first user"
  fi
  chmod 0700 "$pipe" || return 1
  [[ -n ${uids[*]:-} ]] || return 0
  owner=$(stat -c %u "$pipe")
  # Keep the owner while they still have a job here; else the first user with one.
  if [[ " ${uids[*]} " != *" $owner "* ]]; then
    owner=${uids[0]}
    chown "$owner" "$pipe" || return 1
  fi
  for u in $(printf '%s\n' "${uids[@]}" | sort -un); do
    [[ $u == "$owner" ]] || log "GPU $gpu: uid $u cannot reach the MPS daemon without ACLs (install acl); its CUDA runs without MPS"
  done
  return 0
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
# Run the site's own script ($1: a path or a glob, as slurm.conf takes them; [slurm]
# site_prolog, site_epilog, site_task_prolog) with this environment, each match in name
# order; stop at the first that fails and return its status. The fragment's Prolog=,
# Epilog= and TaskProlog= replace the site's keys, so ours run the site's scripts
# (docs/admin.md "Installs that chain"). A literal path that is missing fails, as it
# would for slurmd; a glob that matches nothing runs nothing.
run_site_scripts() {
  local pattern=$1 f rc
  [[ -n $pattern ]] || return 0
  if [[ $pattern != *[*?[]* && ! -x $pattern ]]; then
    echo "slurm-dlrm: the site's script $pattern is missing or not executable" >&2
    return 1
  fi
  # Unquoted on purpose: the glob expands (the loader allows no spaces or quotes in it).
  for f in $pattern; do
    [[ -f $f && -x $f ]] || continue
    "$f"
    rc=$?
    if ((rc != 0)); then
      echo "slurm-dlrm: the site's script $f exited $rc" >&2
      return "$rc"
    fi
  done
  return 0
}
# [slurm] site_epilog: the site's own epilog, run after ours ("" = none).
SITE_EPILOG=''
# [slurm] mps_stop_timeout_s, as a count of 0.1 s polls (per step: quit, SIGTERM, SIGKILL).
STOP_POLLS=100

# True only when Slurm says job $1 is over (an unreachable controller keeps the record): its
# state read alone (job_field), so no job name can pose as JobState=.
job_is_over() {
  local out rc
  out=$(job_field "$1" T 2>&1)
  rc=$?
  [[ $out == *"Invalid job id"* ]] && return 0
  ((rc == 0)) || return 1
  # A controller that answers with no line no longer knows the job (purged after MinJobAge).
  [[ -z $out ]] && return 0
  [[ $out =~ ^(COMPLETED|CANCELLED|FAILED|TIMEOUT|NODE_FAIL|PREEMPTED|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE)$ ]]
}

# Ask GPU $1's daemon to quit in its protocol (v3: -q; v2: quit on the shell).
send_quit() {
  if [[ $(daemon_protocol "$1") == 3 ]]; then
    control3 "$1" -q >/dev/null 2>&1
  else
    control "$1" quit >/dev/null 2>&1
  fi
}

# Stop GPU $1's daemon: `quit`, then SIGTERM, then SIGKILL, each with a bounded wait.
stop_daemon() {
  local gpu=$1 pid sig i
  pid=$(daemon_pid "$gpu")
  if [[ -n $pid ]]; then
    send_quit "$gpu" || log "GPU $gpu: quit was not accepted"
    for sig in "" TERM KILL; do
      if [[ -n $sig ]]; then
        log "GPU $gpu: daemon $pid still runs; sending SIG$sig"
        kill "-$sig" "$pid" 2>/dev/null
      fi
      for ((i = 0; i < STOP_POLLS; i++)); do
        is_alive "$pid" || break 2
        sleep 0.1
      done
    done
    if is_alive "$pid"; then
      log "GPU $gpu: daemon $pid survived SIGKILL"
      return 1
    fi
    log "GPU $gpu: MPS control daemon $pid stopped"
  elif daemon_answers "$gpu"; then
    # A driver that writes no PID file: quit, then poll until the pipe stops answering.
    send_quit "$gpu" || log "GPU $gpu: quit was not accepted"
    for ((i = 0; i < STOP_POLLS; i++)); do
      daemon_answers "$gpu" || break
      sleep 0.1
    done
    if daemon_answers "$gpu"; then
      log "GPU $gpu: daemon ignored quit and has no PID file to signal"
      return 1
    fi
    log "GPU $gpu: MPS control daemon stopped"
  fi
  clean_stale "$gpu"
}

main() {
  local job=${SLURM_JOB_ID:-} record gpu_list gpu other rc=0 gpus
  [[ $job =~ ^[0-9]+$ ]] || return 0
  record=$JOBS_DIR/$job
  [[ -f $record ]] || return 0 # not a gres/mps job, or its prolog never got this far
  read -r gpu_list _ <"$record" || gpu_list=
  exec 9>"$PIPE_ROOT/lock"
  flock -w 60 9 || { log "lock $PIPE_ROOT/lock busy for 60 s"; return 1; }
  IFS=, read -ra gpus <<<"$gpu_list"
  for gpu in "${gpus[@]}"; do
    [[ $gpu =~ ^[0-9]+$ ]] || continue
    rm -f -- "$(gpu_dir "$gpu")/jobs/$job"
    # A job whose epilog never ran (slurmd restarted) must not keep the daemon forever.
    for other in "$(gpu_dir "$gpu")"/jobs/*; do
      [[ -e $other ]] || continue
      if job_is_over "${other##*/}"; then
        log "GPU $gpu: dropping job ${other##*/}, which Slurm reports over"
        rm -f -- "$other" "$JOBS_DIR/${other##*/}"
      fi
    done
    if ! compgen -G "$(gpu_dir "$gpu")/jobs/*" >/dev/null; then
      stop_daemon "$gpu" || rc=1
    else
      # A user whose last job on this GPU ended loses its way to the daemon.
      restrict_pipe "$gpu" || log "GPU $gpu: cannot restrict its pipe folder to the GPU's users"
    fi
  done
  rm -f -- "$record"
  return $rc
}

# Ours, then the site's, whatever ours returned; either failing fails the epilog (drain).
rc=0
main || rc=$?
site_rc=0
run_site_scripts "$SITE_EPILOG" || site_rc=$?
if ((site_rc != 0)); then
  log "the site's epilog ($SITE_EPILOG) exited $site_rc"
  ((rc == 0)) && rc=$site_rc
fi
exit "$rc"
