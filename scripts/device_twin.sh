#!/usr/bin/env bash
# The CPU twin of the lent GPU machine: a Python 3.12 venv (.venv-twin, ignored by git) holding the
# versions that machine's image has (scripts/device_twin_requirements.txt: torch 2.11, transformers
# 5.17, ...) and nothing else, in which `gpu_checks.sh --dry-run` runs every step's CPU part with
# the kit's wheels, with no network (a network namespace of its own where `unshare` allows).
# Run it before any device call: what fails here would fail there, minutes into a 15-minute lease.
#
#   bash scripts/device_kit.sh && bash scripts/device_twin.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/device_twin}"
venv=.venv-twin
requirements=scripts/device_twin_requirements.txt
# A Python 3.12 that runs (a pyenv shim may exist for a version that is not selected).
python312=""
for candidate in ${PYTHON312:-} python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        python312="$candidate"
        break
    fi
done
if [[ -z "$python312" ]]; then
    echo "device_twin.sh: no Python 3.12 here (the GPU machine's version); set PYTHON312 to one" >&2
    exit 1
fi
# (Re)build when the requirements changed since the venv was made.
stamp="$venv/.requirements.sha256"
want="$(sha256sum "$requirements" | cut -d' ' -f1)"
if [[ ! -x "$venv/bin/python" || "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    rm -rf "$venv"
    "$python312" -m venv "$venv"
    # (This machine's pip configuration names local package folders that may not exist: noise.)
    "$venv/bin/pip" install -q -r "$requirements" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
    "$venv/bin/python" -c "import torch, transformers" || { echo "device_twin.sh: the twin's install failed" >&2; exit 1; }
    echo "$want" >"$stamp"
fi
"$venv/bin/python" -c "import torch, transformers; print('twin: python', __import__('platform').python_version(), \
'torch', torch.__version__, 'transformers', transformers.__version__)"
export PYTHON="$PWD/$venv/bin/python"
if unshare -rn true 2>/dev/null; then
    # A user and network namespace: no route out, only a loopback (brought up for the one-rank
    # process groups' TCP store on 127.0.0.1).
    exec unshare -rn sh -c 'ip link set lo up && exec bash scripts/gpu_checks.sh "$@"' sh "$out" --dry-run
fi
echo "device_twin.sh: unshare is not allowed here; the dry run has the network (gpu_checks.sh uses none)" >&2
exec bash scripts/gpu_checks.sh "$out" --dry-run
