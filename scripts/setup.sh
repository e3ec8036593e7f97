#!/usr/bin/env bash
# One set-up path for a fresh Debian 12 machine (run as root). Idempotent: every
# step checks before it acts, so `make demo` / `make test` may call it each time.
#
# GPU clusters: the same pins, with `fbgemm-gpu==1.8.0` instead of `fbgemm-gpu-cpu`
# and torch 2.13.0 from the CUDA index; see docs/install.md.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${SLURM_DLRM_VENV:-$here/.venv}
stamp=$venv/.slurm-dlrm-setup-v1-torch${SLURM_DLRM_SETUP_TORCH:-1}

# lua5.1: the Lua that job_submit_lua.so links (tests run job_submit.lua in it); shellcheck: lints the rendered prolog scripts;
# chromium: tests open the HTML report in a real (headless) browser; acl: setfacl, with which the
# prolog lets a second user's jobs reach a GPU's MPS pipe folder (tests check it).
apt_pkgs=(slurm-wlm munge mariadb-server slurmdbd python3-venv lua5.1 shellcheck chromium acl)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: apt-get install ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  # shellcheck disable=SC2086  # SLURM_DLRM_APT_OPTS: extra apt options (slurm-matrix.sh's sid root)
  apt-get update -qq ${SLURM_DLRM_APT_OPTS:-}
  # policy-rc.d keeps Debian from auto-starting system daemons we start ourselves.
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d
  # shellcheck disable=SC2086
  apt-get install -y -qq ${SLURM_DLRM_APT_OPTS:-} --no-install-recommends "${missing[@]}" >/dev/null
  rm -f /usr/sbin/policy-rc.d
fi

if [[ ! -x $venv/bin/python ]]; then
  python3 -m venv "$venv"
fi
py=$venv/bin/python
if [[ ! -f $stamp || $here/pyproject.toml -nt $stamp ]]; then
  "$py" -m pip install -q --upgrade pip
  # torch first, pinned, so nothing below pulls a CUDA build; fbgemm 1.N pairs with
  # torch 2.(N+5) (crossed pairs fail with "undefined symbol").
  # PyPI's default Linux torch wheel is the CUDA build (several GB of nvidia-* wheels);
  # the CPU build (2.13.0+cpu) comes from PyTorch's CPU index. Skipped where that host
  # does not resolve (offline mirrors, /opt/wheels): pip's own config then decides.
  # SLURM_DLRM_SETUP_TORCH=0 (scripts/slurm-matrix.sh): the project without torch, for the
  # tests that do not need it (torch 2.13 has no CPU wheel for Python 3.13+ on PyPI).
  if [[ ${SLURM_DLRM_SETUP_TORCH:-1} != 0 ]]; then
    torch_index=${SLURM_DLRM_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
    torch_args=()
    if [[ -n $torch_index ]] && getent hosts "$(sed -E 's#^[a-z]+://([^/:]+).*#\1#' <<<"$torch_index")" >/dev/null; then
      torch_args=(--extra-index-url "$torch_index")
    fi
    "$py" -m pip install -q "${torch_args[@]}" torch==2.13.0 fbgemm-gpu-cpu==1.8.0
    # torchrec declares fbgemm-gpu (the CUDA build): install it without deps, then its
    # other needs by hand.
    "$py" -m pip install -q --no-deps torchrec==1.8.0
    "$py" -m pip install -q tensordict 'torchmetrics==1.0.3' tqdm pyre-extensions iopath
  fi
  "$py" -m pip install -q -e "$here[dev]"
  touch "$stamp"
fi
echo "setup: ok ($venv)" >&2
