#!/usr/bin/env bash
# One prepared run on a GPU machine (issue 33): slurm-dlrm selftest, the estimator's CUDA
# rules against plain-torch DLRMs, and a co-location table (MPS, else time-slicing).
#
#   scripts/gpu-check.sh OUTDIR          on the GPU machine (under 8 minutes on an H100)
#   scripts/gpu-check.sh --dry OUTDIR    here: the fake NVML / MPS daemon, torch on the CPU,
#                                        tiny sizes; every output says DRY (tests/test_gpu_check.py)
#
# OUTDIR (new or empty) gets selftest.json, memory.jsonl, colocation.jsonl,
# colocation.csv (`slurm-dlrm interference eval --samples` reads it), summary.txt, log.txt.
# Other options go to `python -m slurm_dlrm.selftest.gpu_check` (--model, --window-s, --skip).
#
# What it needs there: python3 with torch (CUDA), numpy, nvidia-ml-py, click, jinja2,
# psutil, rich, pyyaml: the GPU image has them all. Nothing is installed and nothing is
# carried beside the repository (well under its 64 MiB): the checkout is put first on
# PYTHONPATH, so the package runs from it. The one runtime dependency that image lacks,
# sqlite-utils, is imported only by the store, which these steps never open; torchrec and
# fbgemm-gpu are missing there too, so the selftest's runner specs are SKIP and the
# estimator is checked against plain-torch DLRMs. tests/test_gpu_check.py runs --dry with
# those three modules hidden, so a new import of them on this path fails there first.
#
# Exit codes: 0 the steps ran (read summary.txt for what passed), 2 bad usage.
set -euo pipefail

usage() { echo "usage: scripts/gpu-check.sh [--dry] OUTDIR [--model NAME] [--window-s S] [--skip STEP]" >&2; exit 2; }
[ "$#" -ge 1 ] || usage

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-}"
if [ -z "$py" ]; then
    if [ -x "$repo/.venv/bin/python" ]; then py="$repo/.venv/bin/python"; else py="$(command -v python3)"; fi
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
cd "$repo"
exec "$py" -m slurm_dlrm.selftest.gpu_check "$@"
