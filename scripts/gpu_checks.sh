#!/usr/bin/env bash
# Everything that needs a GPU, in one command: installs the GPU extras into fresh virtual
# environments and runs every GPU test, printing the figures (decode tokens/s).
#
#   bash scripts/gpu_checks.sh [VENV_PREFIX]     # default: .venv-gpu in the repository root
#
# 1. ${VENV_PREFIX}-vllm: hybridflow[test,vllm] (vLLM's GPU build and the CUDA torch it pins)
#    - pytest -m "gpu and not vllm": the native engine's and trainer's GPU tests
#    - tests/unit/rollout/test_rollout_cuda_graphs.py (CUDA-graph decode; skip-if-no-CUDA only)
#    - tests/unit/rollout/test_rollout_vllm_gpu.py, one pytest process per engine (vLLM allows one
#      sleep-mode engine per process): TestFloat32, TestBfloat16, then -m slow (native vs vLLM
#      decode tokens/s at batch 256, with their ratio)
#    - bench/rollout_gpu_decode.py (native decode tokens/s at batch 1/64/256 against the bound)
# 2. ${VENV_PREFIX}-sglang: hybridflow[test,sglang] (SGLang pins its own torch, so a venv of its own)
#    - tests/unit/rollout/test_rollout_sglang_gpu.py against a real SGLang server
#
# Every step runs even when an earlier one fails; the summary at the end lists each step's exit
# status and the script exits non-zero if any failed. Output is also written to gpu_checks.log.
set -uo pipefail
cd "$(dirname "$0")/.."
prefix="${1:-.venv-gpu}"
exec > >(tee gpu_checks.log) 2>&1

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L; then
    echo "gpu_checks.sh: no NVIDIA GPU here (nvidia-smi -L failed); nothing to check" >&2
    exit 1
fi

start=$SECONDS
declare -a summary=()
failed=0

step() {  # step NAME COMMAND...: run, record the exit status, go on
    local name="$1"
    shift
    echo
    echo "=== $name ($((SECONDS - start)) s)"
    "$@"
    local rc=$?
    summary+=("$(printf '%-58s exit %d' "$name" "$rc")")
    [ "$rc" -eq 0 ] || failed=1
}

fresh_venv() {  # fresh_venv DIR EXTRAS
    rm -rf "$1" && python3 -m venv "$1" && "$1/bin/pip" install -q --upgrade pip \
        && "$1/bin/pip" install -q -e ".[$2]"
}

vllm_venv="$prefix-vllm"
step "install hybridflow[test,vllm] into $vllm_venv" fresh_venv "$vllm_venv" test,vllm
py="$vllm_venv/bin/python"
step "versions (vllm venv)" "$py" -c \
    "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), \
'| vllm', vllm.__version__)"
step "pytest -m 'gpu and not vllm'" "$py" -m pytest -n 0 -m "gpu and not vllm" -s
step "pytest test_rollout_cuda_graphs.py" "$py" -m pytest -n 0 tests/unit/rollout/test_rollout_cuda_graphs.py
vllm_gpu=tests/unit/rollout/test_rollout_vllm_gpu.py
step "pytest $vllm_gpu::TestFloat32" "$py" -m pytest -n 0 -s "$vllm_gpu::TestFloat32"
step "pytest $vllm_gpu::TestBfloat16" "$py" -m pytest -n 0 -s "$vllm_gpu::TestBfloat16"
step "pytest -m slow $vllm_gpu (tokens/s)" "$py" -m pytest -n 0 -s -m slow "$vllm_gpu"
step "bench/rollout_gpu_decode.py (native tokens/s)" "$py" bench/rollout_gpu_decode.py

sglang_venv="$prefix-sglang"
step "install hybridflow[test,sglang] into $sglang_venv" fresh_venv "$sglang_venv" test,sglang
step "pytest test_rollout_sglang_gpu.py" "$sglang_venv/bin/python" -m pytest -n 0 -s \
    tests/unit/rollout/test_rollout_sglang_gpu.py

echo
echo "=== gpu_checks.sh: done in $((SECONDS - start)) s"
printf '%s\n' "${summary[@]}"
exit "$failed"
