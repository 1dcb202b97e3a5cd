#!/usr/bin/env bash
# The GPU kit, packed here (on the CPU machine, which reaches PyPI) for a GPU machine that has no
# network: downloads the wheels in scripts/device_kit_requirements.txt into .whl/ (ignored by git),
# checks what travels stays well under the device tool's 64 MiB, and prints the device call to make.
#
#   bash scripts/device_kit.sh            # then: bash scripts/device_twin.sh (the CPU twin's dry run)
set -euo pipefail
cd "$(dirname "$0")/.."
kit=.whl
limit_mib=64
budget_mib=48  # "well under" the limit: room for the tree to grow between kit and call

mkdir -p "$kit"
rm -f "$kit"/*.whl
# Pure-Python wheels for CPython 3.12 on x86-64 (the lent machine's python3); --no-deps: the
# requirements file names every wheel that must travel, and nothing the image already has.
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }  # this machine's pip config
grep -v '^\s*#' scripts/device_kit_requirements.txt | grep -v '^\s*$' | while read -r requirement; do
    if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$kit" "$requirement" 2>/dev/null; then
        # No wheel on PyPI (antlr4 4.9.3 ships only its source): build one here; it must be pure Python.
        python3 -m pip wheel -q --no-deps -w "$kit" "$requirement" 2> >(quiet >&2)
    fi
done
if ls "$kit"/*.whl | grep -v -e '-none-any\.whl$' -e 'cp312' ; then
    echo "device_kit.sh: the wheels above are neither pure Python nor built for CPython 3.12" >&2
    exit 1
fi
wheels=$(ls "$kit"/*.whl | wc -l)
expected=$(grep -cv -e '^\s*#' -e '^\s*$' scripts/device_kit_requirements.txt)
if [[ "$wheels" -ne "$expected" ]]; then
    echo "device_kit.sh: $wheels wheels in $kit, expected $expected (scripts/device_kit_requirements.txt)" >&2
    exit 1
fi

# What the device call sends: tracked files, untracked files git does not ignore, and the kit.
tree_bytes=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 stat -c %s 2>/dev/null \
    | awk '{s += $1} END {printf "%d", s}')
kit_bytes=$(du -cb "$kit"/*.whl | tail -1 | cut -f1)
total_mib=$(( (tree_bytes + kit_bytes) / 1048576 ))
printf 'device kit: %d wheels, %.2f MiB; working tree %.2f MiB; travels %d MiB of %d (budget %d)\n' \
    "$wheels" "$(echo "$kit_bytes / 1048576" | bc -l)" "$(echo "$tree_bytes / 1048576" | bc -l)" \
    "$total_mib" "$limit_mib" "$budget_mib"
if (( total_mib > budget_mib )); then
    echo "device_kit.sh: $total_mib MiB would travel, over the $budget_mib MiB budget: ignore large untracked files" >&2
    exit 1
fi
cat <<'CALL'

Before the call, on this machine: bash scripts/device_twin.sh (the CPU twin's dry run must pass).
Then the device tool's `run`, with
  carry:     [".whl"]
  timeout_s: 540
  command:   bash scripts/gpu_checks.sh "$OUT"
It returns $OUT/gpu_checks.json (every step's figures; rewritten after each step) and
$OUT/gpu_checks.log. Copy the JSON to bench/results/gpu_checks_<date>.json and quote it in the README.
CALL
