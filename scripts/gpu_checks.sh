#!/usr/bin/env bash
# Every CUDA path in one command on a bare GPU machine with no network (the lent H200):
#
#   bash scripts/gpu_checks.sh OUT_DIR [--dry-run] [--only STEP,...]
#
# Uses the machine's own python3 (torch, transformers, ... from its image) plus the wheels that
# scripts/device_kit.sh put in .whl/, installed offline into a temporary folder; hybridflow is
# imported from this tree (nothing is installed from a network, and nothing into the image).
# Then scripts/gpu_checks.py runs the steps, each in its own process and time box, and writes
# OUT_DIR/gpu_checks.json (rewritten after every step) and OUT_DIR/gpu_checks.log.
# --dry-run: each step's CPU part at toy sizes; scripts/device_twin.sh runs it in the CPU twin.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: bash scripts/gpu_checks.sh OUT_DIR [--dry-run] [--only STEP,...]" >&2
    exit 2
fi
out="$1"
shift
dry_run=0
for arg in "$@"; do [[ "$arg" == "--dry-run" ]] && dry_run=1; done
mkdir -p "$out"
python="${PYTHON:-python3}"

if [[ "$dry_run" == 0 ]] && ! nvidia-smi -L; then
    echo "gpu_checks.sh: no NVIDIA GPU here (nvidia-smi -L failed); --dry-run checks the code on a CPU" >&2
    exit 1
fi

# The kit's wheels, offline: --no-index (never a registry), --no-deps (the kit lists every wheel).
site="$(mktemp -d -t gpu-kit-site-XXXX)"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        || { echo "gpu_checks.sh: the kit's wheels did not install (run scripts/device_kit.sh here first)" >&2; exit 1; }
else
    echo "gpu_checks.sh: no wheels in .whl/ (run scripts/device_kit.sh on the CPU machine and carry .whl)" >&2
fi
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
# No hub lookups from transformers or huggingface_hub: the models are built here, not downloaded.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
"$python" -c "import hybridflow.cli, math_verify, hydra, omegaconf" \
    || { echo "gpu_checks.sh: hybridflow does not import with this python and the kit" >&2; exit 1; }
"$python" scripts/gpu_checks.py "$out" "$@"
