#!/bin/bash
# Prolog for site "local" (site.toml), rendered by `slurm-dlrm admin render`.
# slurmd runs it as root when a job is allocated (PrologFlags=Alloc). For a gres/mps job it
# starts the MPS control daemon of the job's GPU (one daemon per GPU, shared by the gres/mps
# jobs on it) and records the job, so the epilog stops the daemon after its last job.
# A non-zero exit drains the node and requeues the job: we exit 1 only when MPS cannot start.
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
# [slurm] site_prolog: the site's own prolog, run first ("" = none).
SITE_PROLOG=''
# [slurm] mps_start_timeout_s, as a count of 0.1 s polls.
START_POLLS=100
# [mps] mps_per_gpu: --gres=mps:N of one GPU is N*100/MPS_PER_GPU percent of its SMs.
MPS_PER_GPU=100
# The --comment marker slurm-dlrm's submissions carry (docs/interfaces.md section 6).
MARKER_PREFIX=slurm-dlrm:
MODE_NO_PACK=no-pack
# [mps] mode: who holds a --no-pack job to its GPU memory (docs/admin.md "Fences"):
# v3 = a server per user with its limits in the daemon (driver r615+), v2 = the user's
# server's set_device_pinned_mem_limit plus the task's own environment, auto = v3 where
# `nvidia-cuda-mps-control -p 3 -h` lists namespace (NVIDIA's check).
FENCE_MODE=auto
# [mps] dmem: cgroup v2 dmem.max/dmem.min on the job's cgroup (auto | on | off);
# [slurm] cgroup_root and job_cgroup say where ({job_id} is replaced).
DMEM_MODE=auto
CGROUP_ROOT=/sys/fs/cgroup
JOB_CGROUP='system.slice/slurmstepd.scope/job_{job_id}'

# [mps] cross_user: MPS runs one user's jobs on a GPU at a time, so jobs of two users on
# one GPU take turns ("time-slice"; "one-user": job_submit.lua gave gres/mps jobs
# --exclusive=user). Either way events.log says when a GPU holds jobs of several users.
CROSS_USER=time-slice

# The uids other than $2 with jobs on GPU $1 (comma-separated; empty if none).
other_users() {
  local f u
  local -a uids=()
  for f in "$(gpu_dir "$1")"/jobs/*; do
    [[ -f $f ]] || continue
    read -r u _ <"$f" 2>/dev/null || continue
    [[ $u =~ ^[0-9]+$ && $u != "$2" ]] && uids+=("$u")
  done
  [[ -n ${uids[*]:-} ]] || return 0
  printf '%s\n' "${uids[@]}" | sort -un | paste -sd, -
}

# The memory of the site's largest GPU ([gpu_models], MiB): a --comment gpu_mem_mib above it
# is held to it (job_submit.lua holds each partition to its own GPUs at submit).
GPU_MEM_MIB_MAX=81920

# The job's gres request per node and its --comment, each read alone (job_field) once per
# job and node; the task prolog only reads what we record, so tasks never ask the controller.
JOB_TRES_PER_NODE=
JOB_COMMENT=
read_job_fields() {
  if ! JOB_TRES_PER_NODE=$(job_field "$SLURM_JOB_ID" b 2>/dev/null) ||
    ! JOB_COMMENT=$(job_field "$SLURM_JOB_ID" k 2>/dev/null); then
    JOB_TRES_PER_NODE='' JOB_COMMENT=''
    log "squeue failed; no memory fence, Slurm's thread percentage"
  fi
}


# The gres/mps count per node in TresPerNode $1: the sum of its mps entries (typed ones too:
# "gres/mps:a:30,gres/mps:b:20" is 50), "gres:" on 22.05, "gres/" later. Fails when $1 is not
# a list of gres entries or names no mps.
mps_count() {
  local tres=$1 item sum=0 found=0
  local -a items f
  [[ $tres =~ ^[A-Za-z0-9_.:/,-]{1,1024}$ ]] || return 1
  IFS=, read -ra items <<<"$tres"
  for item in "${items[@]}"; do
    [[ $item == gres[:/]* ]] || return 1
    IFS=: read -ra f <<<"${item:5}"
    [[ ${#f[@]} -ge 1 && ${f[0]} =~ ^[A-Za-z0-9_-]+$ ]] || return 1
    [[ ${f[0]} == mps ]] || continue
    case ${#f[@]} in
      1) ((sum += 1)) ;;
      2) if [[ ${f[1]} =~ ^[0-9]{1,9}$ ]]; then ((sum += 10#${f[1]})); else ((sum += 1)); fi ;;
      3) [[ ${f[2]} =~ ^[0-9]{1,9}$ ]] || return 1; ((sum += 10#${f[2]})) ;;
      *) return 1 ;;
    esac
    found=1
  done
  ((found)) || return 1
  echo "$sum"
}

# Thread percentage, always within 1..100: from the job's gres/mps count (fallback: what
# Slurm put in the environment).
job_thread_pct() {
  local pct
  # Slurm 22.05.8 with gres/shard configured too divides by the shard count (mps:50 gave 625).
  local count
  if count=$(mps_count "$JOB_TRES_PER_NODE"); then
    pct=$(((count * 100 + MPS_PER_GPU - 1) / MPS_PER_GPU))
    ((pct > 100)) && pct=100
    ((pct < 1)) && pct=1
    echo "$pct"
    return
  fi
  log "cannot read the gres/mps count from squeue; using CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
  pct=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
  [[ $pct =~ ^[0-9]{1,9}$ ]] || pct=100
  pct=$((10#$pct))
  ((pct > 100)) && pct=100
  ((pct < 1)) && pct=1
  echo "$pct"
}

# The per-GPU memory a --no-pack job's --comment marker recorded (docs/interfaces.md
# section 6), at most GPU_MEM_MIB_MAX, else 0 (no fence: packs, whose agent fences each
# member, and other jobs). The whole comment must read as a marker, by job_submit.lua's
# grammar (comma-separated key=value, empty items skipped, a count may have leading
# zeros): a marker it admits must get its fence here, never none.
job_gpu_mem_mib() {
  local comment=$JOB_COMMENT field mode='' mib=''
  local -a fields
  [[ $comment == "$MARKER_PREFIX"* ]] || { echo 0; return; }
  # read takes one line: a comment of several lines is no marker (job_submit.lua refuses it).
  if [[ $comment == *$'\n'* ]]; then
    log "the --comment marker spans several lines; no memory fence"
    echo 0
    return
  fi
  IFS=, read -ra fields <<<"${comment#"$MARKER_PREFIX"}"
  for field in "${fields[@]}"; do
    [[ -z $field ]] && continue
    if ! [[ $field =~ ^[a-z_]+=[A-Za-z0-9._-]+$ ]]; then
      log "the --comment marker does not read as key=value pairs; no memory fence"
      echo 0
      return
    fi
    case $field in
      mode=*) mode=${field#mode=} ;;
      gpu_mem_mib=*) mib=${field#gpu_mem_mib=} ;;
    esac
  done
  if [[ $mode != "$MODE_NO_PACK" || ! $mib =~ ^0*([1-9][0-9]*)$ ]]; then
    echo 0
    return
  fi
  mib=${BASH_REMATCH[1]}
  # Past 9 digits the number is beyond any GPU (and bash's arithmetic): the cap.
  if [[ ! $mib =~ ^[0-9]{1,9}$ ]] || ((GPU_MEM_MIB_MAX > 0 && mib > GPU_MEM_MIB_MAX)); then
    log "gpu_mem_mib=$mib in --comment exceeds the site's largest GPU; held to $GPU_MEM_MIB_MAX MiB"
    mib=$GPU_MEM_MIB_MAX
  fi
  echo "$mib"
}

# The MPS protocol a new daemon gets: [mps] mode, or with auto v3 where the driver has it.
wanted_protocol() {
  case $FENCE_MODE in
    v2) echo 2 ;;
    v3) echo 3 ;;
    *)
      # CUDA_MPS_PROTOCOL_VERSION would win over -p (NVIDIA docs): not here.
      if env -u CUDA_MPS_PROTOCOL_VERSION "$MPS_CONTROL" -p 3 -h </dev/null 2>/dev/null | grep -qw namespace; then
        echo 3
      else
        echo 2
      fi
      ;;
  esac
}

# Start GPU $1's daemon with default thread percentage $2 and wait, bounded, until it answers.
start_daemon() {
  local gpu=$1 pct=$2 pipe logs i proto
  pipe=$(pipe_dir "$gpu")
  logs=$(log_dir "$gpu")
  clean_stale "$gpu"
  mkdir -p "$pipe" "$logs" || return 1
  # Nobody but root until restrict_pipe lets the GPU's users in (before the daemon starts).
  chmod 0700 "$pipe" || return 1
  proto=$(wanted_protocol)
  local -a v3_args=()
  if [[ $proto == 3 ]]; then
    v3_args=(-p 3)
  fi
  echo "$proto" >"$(gpu_dir "$gpu")/protocol" || return 1
  # The daemon must not inherit our lock (fd 9) or slurmd's pipes: it outlives this script.
  if ! CUDA_VISIBLE_DEVICES=$gpu CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$logs \
    CUDA_MPS_PROTOCOL_VERSION=$proto "$MPS_CONTROL" -d "${v3_args[@]}" </dev/null >>"$logs/start.log" 2>&1 9>&-; then
    log "GPU $gpu: $MPS_CONTROL -d ${v3_args[*]} failed (see $logs/start.log)"
    [[ $proto == 3 && $FENCE_MODE == v3 ]] && log "GPU $gpu: mps.mode = v3 needs a driver with MPS v3 (r615+)"
    return 1
  fi
  for ((i = 0; i < START_POLLS; i++)); do
    if daemon_answers "$gpu"; then
      local pid_text
      pid_text=$(daemon_pid "$gpu")
      pid_text=${pid_text:+$pid_text }
      if [[ $proto == 3 ]]; then
        # v3 has no legacy shell; a --no-pack job's server carries its percentage (apply_fence).
        log "GPU $gpu: MPS control daemon ${pid_text}started, protocol 3"
        return 0
      fi
      # Clients carry the job's own percentage (Slurm sets it in the job's environment);
      # the default caps a client that lost it.
      control "$gpu" set_default_active_thread_percentage "$pct" >/dev/null 2>&1 ||
        log "GPU $gpu: set_default_active_thread_percentage $pct refused"
      log "GPU $gpu: MPS control daemon ${pid_text}started, default thread percentage $pct"
      return 0
    fi
    sleep 0.1
  done
  log "GPU $gpu: MPS control daemon did not answer within $START_POLLS polls"
  return 1
}

# The largest gpu_mem_mib of user $2's jobs on GPU $1 (their records: "<uid> <MiB>"): one
# MPS server serves all of a user's clients on a GPU.
user_max_mib() {
  local f uid mib max=0
  for f in "$(gpu_dir "$1")"/jobs/*; do
    [[ -f $f ]] || continue
    read -r uid mib <"$f" 2>/dev/null || continue
    [[ $uid == "$2" && $mib =~ ^[0-9]+$ ]] && ((mib > max)) && max=$mib
  done
  echo "$max"
}

# Hold user $2's clients on GPU $1 to $3 MiB at thread share $4, in the daemon, so a task
# that sets CUDA_MPS_PINNED_DEVICE_MEM_LIMIT itself cannot raise it (docs/admin.md "Fences").
apply_server_fence() {
  local gpu=$1 uid=$2 mib=$3 pct=$4 name pid
  if [[ $(daemon_protocol "$gpu") == 3 ]]; then
    # MPS v3: a server per uid with its limits; its clients reach it by uid routing.
    name=uid$uid
    if control3 "$gpu" server create "--uid=$uid" "--name=$name" "--pinned-memory-limit=${mib}M" \
      "--active-thread-percentage=$pct" >/dev/null 2>&1 ||
      control3 "$gpu" server set "--name=$name" "--pinned-memory-limit=${mib}M" \
        "--active-thread-percentage=$pct" >/dev/null 2>&1; then
      log "GPU $gpu: v3 server $name holds uid $uid to ${mib} MiB, $pct%"
    else
      log "GPU $gpu: the daemon refused server $name with ${mib} MiB (see its control.log)"
    fi
    return 0
  fi
  # MPS v2: the user's server (started now if need be), found by the owner of its process.
  control "$gpu" start_server -uid "$uid" >/dev/null 2>&1
  for pid in $(control "$gpu" get_server_list 2>/dev/null); do
    [[ $pid =~ ^[0-9]+$ && $(stat -c %u "/proc/$pid" 2>/dev/null) == "$uid" ]] || continue
    if control "$gpu" set_device_pinned_mem_limit "$pid" 0 "${mib}M" >/dev/null 2>&1; then
      log "GPU $gpu: v2 server $pid of uid $uid held to ${mib} MiB (a task can still set a higher limit itself)"
    else
      log "GPU $gpu: set_device_pinned_mem_limit $pid 0 ${mib}M refused"
    fi
    return 0
  done
  log "GPU $gpu: no MPS server of uid $uid to limit; the task's environment is the only fence"
}

# dmem.max (hard) and dmem.min (soft) = $3 MiB for GPU $2 on job $1's cgroup (kernel
# cgroup-v2.rst "DMEM"; NVIDIA "MPS v3 Memory Partitioning"). Returns 1 only when the site
# requires dmem (`on`) and this node has no dmem controller.
apply_dmem_fence() {
  local job=$1 gpu=$2 mib=$3 cg region rel part dir
  [[ $DMEM_MODE == off ]] && return 0
  region=
  if grep -qw dmem "$CGROUP_ROOT/cgroup.controllers" 2>/dev/null; then
    # GPU g's region: the g-th nvidia/<pci>/vidmem line in PCI order (NVML's order).
    region=$(awk '$1 ~ /^nvidia\// {print $1}' "$CGROUP_ROOT/dmem.capacity" 2>/dev/null | sort | sed -n "$((gpu + 1))p")
  fi
  if [[ -z $region ]]; then
    log "dmem: no nvidia region for GPU $gpu in $CGROUP_ROOT/dmem.capacity (no dmem controller, or kernel < 6.14)"
    [[ $DMEM_MODE == on ]] && return 1
    return 0
  fi
  rel=${JOB_CGROUP//\{job_id\}/$job}
  cg=$CGROUP_ROOT/$rel
  if [[ ! -d $cg ]]; then
    log "dmem: no job cgroup at $cg ([slurm] job_cgroup); GPU memory not fenced by the kernel"
    return 0
  fi
  # The controller must be enabled from the root down to the job's parent.
  dir=$CGROUP_ROOT
  IFS=/ read -ra parts <<<"${rel%/*}"
  echo +dmem >"$dir/cgroup.subtree_control" 2>/dev/null
  for part in "${parts[@]}"; do
    [[ -n $part ]] || continue
    dir=$dir/$part
    echo +dmem >"$dir/cgroup.subtree_control" 2>/dev/null
  done
  if echo "$region $((mib * 1048576))" >"$cg/dmem.max" && echo "$region $((mib * 1048576))" >"$cg/dmem.min"; then
    log "dmem: job cgroup $cg held to ${mib} MiB on $region"
  else
    log "dmem: cannot write $cg/dmem.max"
  fi
  return 0
}

main() {
  # Slurm sets both only for a gres/mps job (the indices are the node's, not the job's).
  [[ -n ${CUDA_MPS_ACTIVE_THREAD_PERCENTAGE:-} && -n ${CUDA_VISIBLE_DEVICES:-} ]] || return 0
  local job=${SLURM_JOB_ID:-} uid=${SLURM_JOB_UID:-} pct mem_mib gpu gpus others
  [[ $job =~ ^[0-9]+$ ]] || { log "no SLURM_JOB_ID"; return 1; }
  [[ $uid =~ ^[0-9]+$ ]] || uid=
  IFS=, read -ra gpus <<<"$CUDA_VISIBLE_DEVICES"
  for gpu in "${gpus[@]}"; do
    [[ $gpu =~ ^[0-9]+$ ]] || { log "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES is not a list of indices"; return 1; }
  done
  read_job_fields
  pct=$(job_thread_pct)
  mem_mib=$(job_gpu_mem_mib)
  mkdir -p "$PIPE_ROOT" "$JOBS_DIR" || return 1
  exec 9>"$PIPE_ROOT/lock"
  flock -w 60 9 || { log "lock $PIPE_ROOT/lock busy for 60 s"; return 1; }
  for gpu in "${gpus[@]}"; do
    mkdir -p "$(gpu_dir "$gpu")/jobs" && echo "${uid:--} $mem_mib" >"$(gpu_dir "$gpu")/jobs/$job" || return 1
    if ! daemon_up "$gpu" && ! start_daemon "$gpu" "$pct"; then
      rm -f -- "$(gpu_dir "$gpu")/jobs/$job"
      return 1
    fi
    if ! restrict_pipe "$gpu"; then
      log "GPU $gpu: cannot restrict its pipe folder to the GPU's users"
      rm -f -- "$(gpu_dir "$gpu")/jobs/$job"
      return 1
    fi
    others=$(other_users "$gpu" "$uid")
    if [[ -n $others && -n $uid ]]; then
      log "GPU $gpu: uid $uid shares it with uid $others: MPS runs one user's jobs at a time, so they take turns ([mps] cross_user = $CROSS_USER)"
    fi
    # A --no-pack job's fence, held outside the job (docs/admin.md "Fences").
    if ((mem_mib > 0)); then
      [[ -n $uid ]] && apply_server_fence "$gpu" "$uid" "$(user_max_mib "$gpu" "$uid")" "$pct"
      if ! apply_dmem_fence "$job" "$gpu" "$mem_mib"; then
        rm -f -- "$(gpu_dir "$gpu")/jobs/$job"
        return 1
      fi
    fi
  done
  # Read by the task prolog (as the job's user) and by the epilog.
  printf '%s %s %s %s\n' "$(IFS=,; echo "${gpus[*]}")" "$pct" "$mem_mib" "$(daemon_protocol "${gpus[0]}")" \
    >"$JOBS_DIR/.$job.tmp" &&
    chmod 0644 "$JOBS_DIR/.$job.tmp" && mv -f "$JOBS_DIR/.$job.tmp" "$JOBS_DIR/$job"
}

# The site's prolog first: if it fails, so does this one (Slurm drains the node and
# requeues the job) and no MPS daemon starts.
site_rc=0
run_site_scripts "$SITE_PROLOG" || site_rc=$?
if ((site_rc != 0)); then
  log "the site's prolog ($SITE_PROLOG) exited $site_rc"
  exit "$site_rc"
fi
main
