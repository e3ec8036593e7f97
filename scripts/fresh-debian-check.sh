#!/usr/bin/env bash
# Check the README's promise on a fresh Debian 12: its test command (through the CI entry
# point .ci/run) and its demo command on a minimal bookworm root with nothing installed
# beyond what debootstrap's minbase variant brings and git (CI gets a clone).
#
#   sudo scripts/fresh-debian-check.sh [--rebuild] [--no-demo] [--keep-mounted]
#
# Steps (each safe to repeat):
#   1. debootstrap --variant=minbase --include=git bookworm into $FRESH_ROOT.pristine
#      (default /srv/deb12.pristine), once; --rebuild builds it again. Every run starts
#      from a new copy of it in $FRESH_ROOT (/srv/deb12), so no apt package or venv from
#      an earlier run hides a missing install step.
#   2. Mounts /proc, /sys (with the host's /sys/fs/cgroup), /dev, /dev/pts, and tmpfs on
#      /dev/shm and /run (the daemons are started by our code, not systemd).
#   3. `git clone` of this checkout's HEAD into /root/repo (commit first: uncommitted
#      changes are not checked).
#   4. In the chroot, as root with a clean environment: `bash .ci/run` (scripts/run.sh
#      installs `make`, which a fresh Debian lacks), then `bash scripts/run.sh demo`. Logs (each line prefixed with the seconds
#      since the step began, so ci.log shows where set-up ends) and wall times:
#      $FRESH_ROOT.log/{ci.log,demo.log,times}.
#   5. Clean-up: `slurm-dlrm cluster down` in the chroot, then any process left whose
#      root is the chroot (only those: the chroot shares the host's pid and network
#      namespaces, so the host's own clusters are in the same process table), umount.
#
# Stand-ins for the network of a real machine (nothing else enters the chroot):
#   - /etc/resolv.conf and the host's /etc/hosts entries (mirrors resolved there).
#   - The host's CA bundle, read-only in /opt/host-ca and given to pip only (PIP_CERT):
#     where HTTPS goes through an intercepting proxy, its CA is in there.
#   - If download.pytorch.org does not resolve (setup.sh then skips PyTorch's CPU index,
#     and plain PyPI would pull the multi-GB CUDA torch), the host's /opt/wheels (the
#     same torch==2.13.0+cpu wheel) is bind-mounted read-only and given as
#     PIP_FIND_LINKS. The host's pip cache is bind-mounted if present (same downloads).
#
# Limits of a chroot (not a real machine): same kernel, hostname, cgroups, pid and
# network namespace as the host (ports of the host's own clusters are busy and the
# chroot's cluster moves to other ones, docs/cluster.md); no systemd, so the system
# services Debian enables for munge, MariaDB and Slurm never run here (setup.sh keeps
# them from starting at install time with policy-rc.d; on a real machine munge and
# MariaDB start at the next boot, on their default socket and port 3306, not ours; the
# Slurm units need /etc/slurm/slurm.conf, which Debian does not ship).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
root=${FRESH_ROOT:-/srv/deb12}
pristine=$root.pristine
logs=$root.log
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
rebuild=0 demo=1 keep=0
for a in "$@"; do
  case $a in
    --rebuild) rebuild=1 ;;
    --no-demo) demo=0 ;;
    --keep-mounted) keep=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "fresh-debian-check: unknown option $a" >&2; exit 2 ;;
  esac
done
[[ $(id -u) == 0 ]] || { echo "fresh-debian-check: run as root" >&2; exit 2; }

# "" is the root itself, bound onto itself first (so unmounted last): on a real machine /
# is a mount point, and `unshare --propagation private` (the CI's Slurm 24.11 leg,
# scripts/slurm-matrix.sh) fails with EINVAL in a chroot whose / is not one.
mounts=("" proc sys sys/fs/cgroup dev dev/pts dev/shm run root/.cache/pip opt/wheels opt/host-ca)
umount_all() {
  local m i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    m=$root/${mounts[i]}
    if mountpoint -q "$m"; then umount -R "$m" 2>/dev/null || umount -R -l "$m"; fi
  done
}

# Processes whose root directory is the chroot: ours, and only ours.
chroot_pids() {
  local p r
  for p in /proc/[0-9]*; do
    r=$(readlink "$p/root" 2>/dev/null) || continue
    [[ $r == "$root" ]] && echo "${p#/proc/}"
  done
  return 0
}

# shellcheck disable=SC2317  # run by the EXIT trap
cleanup() {
  set +e
  if [[ -x $root/root/repo/.venv/bin/slurm-dlrm ]] && mountpoint -q "$root/proc"; then
    in_chroot bash -c 'cd /root/repo && timeout 120 .venv/bin/slurm-dlrm cluster down' >>"$logs/cleanup.log" 2>&1
  fi
  local left
  left=$(chroot_pids)
  if [[ -n $left ]]; then
    echo "fresh-debian-check: processes left in the chroot, stopping them:" >&2
    for p in $left; do echo "  $p $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null)" >&2; done
    # shellcheck disable=SC2086
    kill $left 2>/dev/null; sleep 3
    left=$(chroot_pids)
    # shellcheck disable=SC2086
    [[ -z $left ]] || kill -9 $left 2>/dev/null
  fi
  ((keep)) || umount_all
}

in_chroot() {
  local extra=()
  mountpoint -q "$root/opt/wheels" && extra+=(PIP_FIND_LINKS=/opt/wheels)
  mountpoint -q "$root/opt/host-ca" && extra+=(PIP_CERT=/opt/host-ca/ca-certificates.crt)
  env -i HOME=/root TERM=dumb PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    "${extra[@]}" chroot "$root" "$@"
}

# Seconds since the start of the step before each line, so the log shows where set-up ends.
stamp() {
  local t0=$SECONDS line
  while IFS= read -r line; do printf '%5d %s\n' $((SECONDS - t0)) "$line"; done
}

mkdir -p "$logs"
if [[ -e $root ]]; then
  umount_all
  [[ -z $(chroot_pids) ]] || { echo "fresh-debian-check: processes still run in $root" >&2; exit 1; }
fi
if ((rebuild)); then rm -rf --one-file-system "$pristine"; fi

# 1. The pristine root, built once.
if [[ ! -f $pristine/.fresh-debian-ok ]]; then
  command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap
  rm -rf --one-file-system "$pristine"
  t0=$SECONDS
  debootstrap --variant=minbase --include=git bookworm "$pristine" "$mirror" >"$logs/debootstrap.log" 2>&1 \
    || { tail -20 "$logs/debootstrap.log" >&2; exit 1; }
  # The mirror as the host sees it, plus the security suite, as on an installed system.
  cat >"$pristine/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb ${mirror%/debian}/debian-security bookworm-security main
EOF
  echo "debootstrap_s=$((SECONDS - t0))" >"$logs/debootstrap.time"
  touch "$pristine/.fresh-debian-ok"
fi

# 2. A fresh copy of it for this run.
rm -rf --one-file-system "$root"
cp -a "$pristine" "$root"
cp /etc/resolv.conf "$root/etc/resolv.conf"
# Debian's installer writes localhost and the machine's name; the host's other entries
# are how its mirrors resolve here.
{ printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n' "$(hostname)"; grep -vE '^\s*(#|$)' /etc/hosts || true; } >"$root/etc/hosts"

trap cleanup EXIT
mount --bind "$root" "$root"
mount -t proc proc "$root/proc"
mount -t sysfs sys "$root/sys"
# A fresh sysfs has nothing on /sys/fs/cgroup; on a real machine systemd mounts it, and
# slurmd 22.05 refuses to start without it even with proctrack/linuxproc and task/none.
mount --rbind /sys/fs/cgroup "$root/sys/fs/cgroup"
mount --bind /dev "$root/dev"
mount --bind /dev/pts "$root/dev/pts"
mount -t tmpfs -o mode=1777 shm "$root/dev/shm"
mount -t tmpfs -o mode=0755 run "$root/run"
if [[ -d /root/.cache/pip ]]; then
  mkdir -p "$root/root/.cache/pip"; mount --bind /root/.cache/pip "$root/root/.cache/pip"
fi
if [[ -f /etc/ssl/certs/ca-certificates.crt ]]; then
  mkdir -p "$root/opt/host-ca"; mount --bind -o ro /etc/ssl/certs "$root/opt/host-ca"
fi
if ! getent hosts download.pytorch.org >/dev/null && [[ -d /opt/wheels ]]; then
  mkdir -p "$root/opt/wheels"; mount --bind -o ro /opt/wheels "$root/opt/wheels"
fi

# 3. The checkout, as CI gets it.
git clone -q "$here" "$root/root/repo"
echo "commit=$(git -C "$root/root/repo" rev-parse --short HEAD)" >"$logs/times"
: >"$logs/cleanup.log"

# 4. The README's commands.
rc=0
t0=$SECONDS
in_chroot bash -c 'cd /root/repo && bash .ci/run' 2>&1 | stamp >"$logs/ci.log" || rc=$?
echo "ci_s=$((SECONDS - t0)) ci_rc=$rc" >>"$logs/times"
if ((rc == 0 && demo)); then
  t0=$SECONDS
  in_chroot bash -c 'cd /root/repo && bash scripts/run.sh demo' 2>&1 | stamp >"$logs/demo.log" || rc=$?
  echo "demo_s=$((SECONDS - t0)) demo_rc=$rc" >>"$logs/times"
fi
tail -15 "$logs/ci.log"
cat "$logs/times"
exit "$rc"
