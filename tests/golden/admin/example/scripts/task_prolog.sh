#!/bin/bash
# TaskProlog for site "local" (site.toml), rendered by `slurm-dlrm admin render`.
# slurmstepd runs it as the job's user before each task; the "export NAME=value" and
# "unset NAME" lines it prints change that task's environment. For a gres/mps job whose
# daemon the prolog started it points the task at that daemon, and for a `--no-pack` job on
# an MPS v2 daemon it sets CUDA_MPS_PINNED_DEVICE_MEM_LIMIT from the gpu_mem_mib its --comment recorded,
# which the prolog read once (Slurm itself sets only the thread percentage, never a
# memory limit). It asks Slurm nothing, so many tasks cost the controller nothing.
set -u

# [slurm] mps_pipe_root and mps_log_root, as in the prolog.
PIPE_ROOT=/run/slurm-dlrm/mps
LOG_ROOT=/var/log/slurm-dlrm/mps
# [slurm] site_task_prolog: the site's own task prolog ("" = none). It runs first and its
# lines pass on to slurmstepd; ours come after, so for the CUDA_MPS_* variables ours win.
SITE_TASK_PROLOG=''
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

main() {
  [[ -n ${CUDA_MPS_ACTIVE_THREAD_PERCENTAGE:-} && ${SLURM_JOB_ID:-} =~ ^[0-9]+$ ]] || return 0
  # Written by the prolog (root): "<GPU indices> <thread pct> <gpu_mem_mib, 0 = none> <protocol>".
  local record=$PIPE_ROOT/jobs/$SLURM_JOB_ID gpu_list pct mem_mib proto gpu
  [[ -r $record ]] || return 0 # the prolog started no daemon for this job
  read -r gpu_list pct mem_mib proto <"$record" || return 0
  gpu=${gpu_list%%,*}
  [[ $gpu =~ ^[0-9]+$ && $pct =~ ^[0-9]+$ ]] || return 0
  echo "export CUDA_MPS_PIPE_DIRECTORY=$PIPE_ROOT/gpu$gpu/pipe"
  echo "export CUDA_MPS_LOG_DIRECTORY=$LOG_ROOT/gpu$gpu"
  echo "export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct"
  # The daemon sees only its GPU and shows it to clients as device 0 (NVIDIA: do not set
  # CUDA_VISIBLE_DEVICES in an MPS client's environment).
  echo "unset CUDA_VISIBLE_DEVICES"
  # A --no-pack job's per-GPU memory from its --comment marker (docs/interfaces.md section 6),
  # as the task's own variable only with MPS v2: with v3 the daemon holds its user's server
  # to it (the prolog's apply_server_fence), which the task cannot raise.
  if [[ ${mem_mib:-0} =~ ^[1-9][0-9]*$ && ${proto:-2} != 3 ]]; then
    echo "export CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=${mem_mib}M"
  fi
}

site_rc=0
run_site_scripts "$SITE_TASK_PROLOG" || site_rc=$?
main
exit "$site_rc"
