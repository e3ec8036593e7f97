#!/usr/bin/env bash
# shellcheck disable=SC2016  # the single-quoted bash -c programs expand in the root, not here
# Run the project's Slurm-facing tests on each Slurm release Debian ships, each in a
# minimal Debian root of its own (debootstrap), and end with one line of counts.
#
#   sudo bash scripts/slurm-matrix.sh [--parallel] [RELEASE...]   # default: 22.05 24.11 26.05
#   sudo bash scripts/slurm-matrix.sh build CODENAME...  # only build/refresh the cached roots
#   sudo bash scripts/slurm-matrix.sh exec CODENAME [--repo DIR] [--isolated] -- CMD [ARG...]
#
# Releases and their roots: 22.05 -> bookworm (Debian 12), 24.11 -> trixie (Debian 13),
# 26.05 -> sid. The last line is
#   slurm-matrix: 22.05=P/F 24.11=P/F 26.05=P/F
# with P passed and F failed tests (errors and skipped tests count as failed, but for the
# modules that need torch, which skip themselves; the demo counts as one test); exit
# 0 only if every leg has F=0. --parallel runs the legs side by side (each in its own
# namespaces, root, venv and cluster folder; .ci/run uses it: on 2 cores two legs take
# about 1.3x one leg, since much of a live test is waiting on Slurm), each leg's progress
# lines printed when it ends.
#
# What a leg does:
#   1. The root ($SLURM_MATRIX_ROOTS/CODENAME, default /srv/slurm-matrix) is built once by
#      `debootstrap --variant=minbase` and cached; `build` or a missing
#      ROOT.ready rebuilds it. The mirror's sid Release file may be past its Valid-Until
#      date, so apt in sid roots runs with Check-Valid-Until=false.
#   2. In the root: scripts/setup.sh with SLURM_DLRM_SETUP_TORCH=0, i.e. the same apt
#      packages as on Debian 12 but from that release (Slurm, munge, MariaDB, slurmdbd,
#      Lua, shellcheck), and a venv of the project without torch at DIR/.venv-CODENAME
#      (torch 2.13 has no CPU wheel for Python 3.13/3.14 on PyPI; the tests that need it
#      are marked `torch` and deselected here).
#   3. In new pid, mount and network namespaces (only loopback; everything started there,
#      slurmctld, slurmd, munged, mariadbd, is gone when the leg ends, and no port or
#      process of the host's own clusters is touched), with CI=true so a cluster that
#      does not come up fails the tests instead of skipping them:
#        pytest -m "not torch"       (every Slurm-marked test among them)
#        slurm-dlrm demo --standin   (the demo's Slurm path, members are stand-ins)
#      Logs: $SLURM_MATRIX_ROOTS/log/CODENAME-{setup,pytest,demo}.log.
#
# The checkout is bind-mounted into the root at its own path (commit nothing first: the
# working tree is what runs). `exec` runs one command in a root the same way (host
# network unless --isolated), e.g. to record a release's output:
#   bash scripts/slurm-matrix.sh exec trixie -- .venv-trixie/bin/slurm-dlrm cluster up
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
roots=${SLURM_MATRIX_ROOTS:-/srv/slurm-matrix}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
logs=$roots/log

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "slurm-matrix: $*" >&2; exit 2; }

codename_of() {
  case $1 in
    22.05|bookworm) echo bookworm ;;
    24.11|trixie) echo trixie ;;
    26.05|sid) echo sid ;;
    *) die "unknown release '$1' (known: 22.05 24.11 26.05, or bookworm trixie sid)" ;;
  esac
}
release_of() { case $1 in bookworm) echo 22.05 ;; trixie) echo 24.11 ;; sid) echo 26.05 ;; esac; }

apt_opts() { if [[ $1 == sid ]]; then echo "-o Acquire::Check-Valid-Until=false"; fi; }

# 1. The cached root of one release.
build_root() {
  local code=$1 root=$roots/$1 t0=$SECONDS
  command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  rm -rf --one-file-system "$root" "$root.ready"
  mkdir -p "$logs"
  echo "slurm-matrix: debootstrap $code into $root" >&2
  debootstrap --variant=minbase --include=ca-certificates "$code" "$root" "$mirror" \
    >"$logs/$code-debootstrap.log" 2>&1 || { tail -20 "$logs/$code-debootstrap.log" >&2; return 1; }
  if [[ $code == sid ]]; then
    echo "deb [check-valid-until=no] $mirror sid main" >"$root/etc/apt/sources.list"
  else
    echo "deb $mirror $code main" >"$root/etc/apt/sources.list"
  fi
  # Debian enables the services it installs; there is no init here, and we start our own.
  printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"; chmod +x "$root/usr/sbin/policy-rc.d"
  local t1=$SECONDS
  # The release's packages go into the cached root now (a venv of this checkout too).
  copy_host_files "$code"
  setup_leg "$code" "$here" || return 1
  echo "debootstrap_s=$((t1 - t0)) setup_s=$((SECONDS - t1))" >"$root.ready"
}

ensure_root() {
  # iproute2 (`ip`, for the leg's loopback) is not in a minimal Debian image.
  command -v ip >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
  [[ -f $roots/$1.ready ]] || build_root "$1"
  copy_host_files "$1"
}

# How names resolve on the host (the mirrors), as an installed system would have it.
copy_host_files() {
  cp /etc/resolv.conf "$roots/$1/etc/resolv.conf"
  { printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n' "$(hostname)"; grep -vE '^\s*(#|$)' /etc/hosts || true; } \
    >"$roots/$1/etc/hosts"
}

# Run CMD in ROOT inside new mount + pid namespaces (+ net with --isolated). All mounts
# live in that mount namespace and every process in that pid namespace, so both vanish
# with it: nothing to clean up by hand, nothing of the host's to hit by mistake.
in_root() {
  local code=$1 repo=$2 isolated=$3; shift 3
  local root=$roots/$code
  local -a ns=(--mount --pid --fork --propagation private)
  ((isolated)) && ns+=(--net)
  local -a envs=(HOME=/root TERM=dumb LANG=C.UTF-8 CI="${CI:-true}"
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
    DEBIAN_FRONTEND=noninteractive
    # A state folder and ports of their own: the host's cluster of this checkout derives
    # the same ones from the same path.
    "SLURM_DLRM_CLUSTER_DIR=/tmp/slurm-dlrm-matrix-$code"
    SLURM_DLRM_VENV="$repo/.venv-$code" SLURM_DLRM_SETUP_TORCH=0
    SLURM_DLRM_APT_OPTS="$(apt_opts "$code")")
  # pip's CA bundle: the one pip is given here (PIP_CERT, e.g. a proxy's CA inside
  # scripts/fresh-debian-check.sh's root), else the system's.
  local ca_dir=/etc/ssl/certs ca_file=ca-certificates.crt
  if [[ -n ${PIP_CERT:-} && -f $PIP_CERT ]]; then ca_dir=$(dirname "$PIP_CERT"); ca_file=$(basename "$PIP_CERT"); fi
  [[ -f $ca_dir/$ca_file ]] && envs+=("PIP_CERT=/opt/host-ca/$ca_file")
  unshare "${ns[@]}" env ROOT="$root" REPO="$repo" ISOLATED="$isolated" CA_DIR="$ca_dir" bash -c '
    set -e
    if [[ $ISOLATED == 1 ]]; then
      # Only loopback. glibc getaddrinfo(AI_ADDRCONFIG), which slurmdbd and slurmctld use,
      # ignores 127.0.0.1 when it looks for a configured IPv4 address ("Address family not
      # supported by protocol"), so loopback gets a second one.
      ip link set lo up
      ip addr add 127.0.0.2/32 dev lo
    fi
    mount -t proc proc "$ROOT/proc"
    mount -t sysfs sys "$ROOT/sys"
    # slurmd 22.05 does not start without a cgroup mount (systemd makes one on a real machine).
    mount --rbind /sys/fs/cgroup "$ROOT/sys/fs/cgroup"
    mount --bind /dev "$ROOT/dev"
    mount --bind /dev/pts "$ROOT/dev/pts"
    mount -t tmpfs -o mode=1777 shm "$ROOT/dev/shm"
    mount -t tmpfs -o mode=0755 run "$ROOT/run"
    mkdir -p "$ROOT$REPO" "$ROOT/root/.cache/pip" "$ROOT/opt/host-ca"
    mount --bind "$REPO" "$ROOT$REPO"
    [[ -d /root/.cache/pip ]] && mount --bind /root/.cache/pip "$ROOT/root/.cache/pip"
    [[ -d $CA_DIR ]] && mount --bind -o ro "$CA_DIR" "$ROOT/opt/host-ca"
    # Not exec: this bash stays pid 1 of the namespace and reaps the orphans it adopts
    # (killed members, daemons), as init does; the tests kill -9 processes and wait for them.
    rc=0; chroot "$ROOT" "$@" || rc=$?; exit "$rc"
  ' in-root env -i "${envs[@]}" bash -c 'cd "$1" && shift && exec "$@"' in-root "$repo" "$@"
}

setup_leg() {
  local code=$1 repo=$2
  in_root "$code" "$repo" 0 bash scripts/setup.sh >"$logs/$code-setup.log" 2>&1 \
    || { tail -20 "$logs/$code-setup.log" >&2; return 1; }
}

# pytest's closing line, e.g. "=== 5 failed, 800 passed, 3 skipped in 212.01s ===".
count_of() { grep -Eo "[0-9]+ $1" <<<"$2" | tail -n 1 | grep -Eo '^[0-9]+' || echo 0; }

run_leg() {
  local code=$1 repo=$2 rel; rel=$(release_of "$1")
  local t0=$SECONDS passed failed errors skipped last demo_rc=0
  ensure_root "$code"
  echo "slurm-matrix: $rel ($code): set-up" >&2
  if ! setup_leg "$code" "$repo"; then
    result+=("$rel=0/setup-failed"); bad=1; return 0
  fi
  echo "slurm-matrix: $rel ($code): pytest -m 'not torch'" >&2
  in_root "$code" "$repo" 1 bash -c '"$0" -m pytest -q -m "not torch" -p no:cacheprovider "$@"' \
    ".venv-$code/bin/python" >"$logs/$code-pytest.log" 2>&1 || true
  last=$(grep -E '(passed|failed|error)' "$logs/$code-pytest.log" | tail -n 1)
  passed=$(count_of passed "$last"); failed=$(count_of failed "$last")
  errors=$(count_of 'errors?' "$last")
  # Skips count as failures (pytest's -ra lines), but for the torch modules' importorskip
  # and the live test that needs Slurm to constrain memory, on a host that cannot (no
  # writable cgroup v1 memory controller: slurm_dlrm/localcluster/memory_cgroup.py; its line says why).
  skipped=$(grep -E '^SKIPPED ' "$logs/$code-pytest.log" \
    | grep -cvE "could not import '(torch|torchrec|fbgemm_gpu)'|the local cluster cannot constrain memory on this host" || true)
  echo "slurm-matrix: $rel ($code): demo --standin" >&2
  in_root "$code" "$repo" 1 bash -c '"$0" demo --standin --no-report && "$0" cluster down' \
    ".venv-$code/bin/slurm-dlrm" >"$logs/$code-demo.log" 2>&1 || demo_rc=$?
  if ((demo_rc)); then failed=$((failed + 1)); else passed=$((passed + 1)); fi
  failed=$((failed + errors + skipped))
  if ((failed || !passed)); then
    bad=1
    # Enough to see what failed where only this output is kept (CI).
    grep -E '^(FAILED|ERROR|SKIPPED) ' "$logs/$code-pytest.log" | cut -c1-300 | sed "s/^/  $rel: /" >&2 || true
    ((demo_rc == 0)) || tail -n 15 "$logs/$code-demo.log" | sed "s/^/  $rel demo: /" >&2
  fi
  echo "slurm-matrix: $rel ($code): ${last:-no pytest summary} | demo rc=$demo_rc | $((SECONDS - t0)) s" >&2
  result+=("$rel=$passed/$failed")
}

[[ $(id -u) == 0 ]] || die "run as root (debootstrap, chroot, namespaces, slurmd)"
case ${1:-} in
  -h|--help) usage; exit 0 ;;
  build)
    shift; (($#)) || die "build: name at least one of bookworm trixie sid"
    for r in "$@"; do build_root "$(codename_of "$r")"; done
    exit 0 ;;
  exec)
    shift; code=$(codename_of "${1:-}"); shift
    repo=$here isolated=0
    while (($#)); do
      case $1 in
        --repo) repo=$(cd "$2" && pwd); shift 2 ;;
        --isolated) isolated=1; shift ;;
        --) shift; break ;;
        *) die "exec: unknown option $1 (put the command after --)" ;;
      esac
    done
    (($#)) || die "exec: no command after --"
    ensure_root "$code"
    setup_leg "$code" "$repo"
    in_root "$code" "$repo" "$isolated" "$@"
    exit ;;
esac

parallel=0
if [[ ${1:-} == --parallel ]]; then parallel=1; shift; fi
releases=("$@")
((${#releases[@]})) || releases=(22.05 24.11 26.05)
codes=()
for r in "${releases[@]}"; do codes+=("$(codename_of "$r")"); done
result=() bad=0
mkdir -p "$logs"
if ((parallel)); then
  # Host tools first: two legs installing them at once would meet on dpkg's lock.
  for tool in debootstrap ip; do
    command -v "$tool" >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      "$( [[ $tool == ip ]] && echo iproute2 || echo debootstrap)" >/dev/null
  done
  pids=()
  for code in "${codes[@]}"; do
    rm -f "$logs/$code.result"
    # shellcheck disable=SC2030  # each leg's result travels through its .result file
    ( result=() bad=0; run_leg "$code" "$here"; echo "${result[*]} $bad" >"$logs/$code.result" ) \
      >"$logs/$code-leg.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || true; done
  for code in "${codes[@]}"; do
    cat "$logs/$code-leg.log" >&2
    if [[ -s $logs/$code.result ]]; then
      read -r res leg_bad <"$logs/$code.result"
      # shellcheck disable=SC2031
      result+=("$res")
      if ((leg_bad)); then bad=1; fi
    else
      result+=("$(release_of "$code")=0/leg-died"); bad=1
    fi
  done
else
  for code in "${codes[@]}"; do run_leg "$code" "$here"; done
fi
echo "slurm-matrix: ${result[*]}"
exit "$bad"
