#!/usr/bin/env bash
# The README's two commands on a machine that may not have `make` yet (a fresh Debian
# 12 image does not): install it, then run the Makefile target, which sets up the rest.
#   bash scripts/run.sh demo    # = make demo
#   bash scripts/run.sh test    # = make test
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  demo|test|setup|lint) ;;
  *) echo "usage: bash scripts/run.sh demo|test|setup|lint" >&2; exit 2 ;;
esac
if ! command -v make >/dev/null; then
  if [[ $(id -u) != 0 ]]; then
    echo "run: make is not installed; as root: apt-get install make (set-up installs Slurm too, so run this as root)" >&2
    exit 1
  fi
  echo "run: apt-get install make" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends make >/dev/null
fi
exec make "$1"
