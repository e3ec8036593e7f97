#!/usr/bin/env bash
# One prepared run on a GPU machine (issues 33, 38): slurm-dlrm selftest, our runner
# (backend torch) per memory config beside the estimate, a real pack under the agent with
# the service's fences, and co-location groups of 2-5, twice each, with GPM metrics.
#
#   scripts/gpu-check.sh OUTDIR          on the GPU machine (under 8 minutes on an H100)
#   scripts/gpu-check.sh --dry OUTDIR    here: the fake NVML / MPS daemon, torch on the CPU,
#                                        tiny sizes; every output says DRY (tests/test_gpu_check.py)
#
# OUTDIR (new or empty) gets selftest.json, memory.jsonl, pack.jsonl, colocation.jsonl,
# colocation.csv (`slurm-dlrm interference eval --samples` reads it), summary.txt, log.txt.
# Other options go to `python -m slurm_dlrm.selftest.gpu_check` (--model, --window-s, --skip).
# Device time: a lent machine gives one call up to 10 minutes; run it with a timeout of
# about 540 s (the steps budget themselves to end inside 8 minutes).
#
# What it needs there: python3 with torch (CUDA), numpy, nvidia-ml-py, click, jinja2,
# psutil, rich, pyyaml: the GPU image has them all. Nothing is installed and nothing is
# carried beside the repository (well under its 64 MiB): the checkout is put first on
# PYTHONPATH, so the package runs from it. The one runtime dependency that image lacks,
# sqlite-utils, is not needed by these steps (the pack step's store is sqlite3); torchrec
# and fbgemm-gpu are missing there too, so the runner trains with backend torch and the
# selftest's torchrec specs are SKIP. tests/test_gpu_check.py runs --dry with
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
