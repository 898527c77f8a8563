#!/usr/bin/env bash
# Prepares .device/ (git-ignored) for a call on a lent GPU machine, which reaches no package index and
# receives the working tree without its history: Meta's Distributed Shampoo installed from ../shared/peers
# into .device/site, and the commit the tree is at in .device/commit. Name .device in the call's carry;
# benchmarks/device_checks.sh reads both.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
rm -rf .device
mkdir -p .device/site
tarball=$(ls ../shared/peers/torch-shampoo-*.tar.gz 2>/dev/null | tail -1 || true)
if [ -n "$tarball" ]; then
  "$python" -m pip install --quiet --no-deps --ignore-requires-python --target .device/site "$tarball"
else
  echo "no ../shared/peers/torch-shampoo-*.tar.gz: Meta's Distributed Shampoo will be recorded unavailable"
fi
git rev-parse HEAD > .device/commit
du -sh .device
