#!/usr/bin/env bash
# Install everything from scratch and run the test suite: the README's test command, and exactly
# what CI (.ci/run) runs, so the two cannot disagree on which tests run.
#
#   bash scripts/test.sh [PYTEST ARGS...]
#
# The live run page's browser test (tests/e2e/test_e2e_dashboard.py) drives Debian's Chromium
# through its driver: installed here where apt-get can (as root, or with sudo that needs no
# password; about a minute), else that one test skips and says why.
set -euo pipefail
cd "$(dirname "$0")/.."
# jemalloc (the hybridflow command runs under it where present) likewise, so its re-execution test runs and the
# command-line tests run as a user's would; and a C compiler, which builds the native engine's bf16 kernel
# (hybridflow/inference/cpu_kernels.py; its tests skip on a CPU without avx512_bf16).
jemalloc_missing() { ! ls /usr/lib/*/libjemalloc.so.2 /usr/lib64/libjemalloc.so.2 >/dev/null 2>&1; }
if [[ ! -x /usr/bin/chromium || ! -x /usr/bin/chromedriver ]] || jemalloc_missing || ! command -v cc >/dev/null; then
    if command -v apt-get >/dev/null; then
        sudo=""; [[ "$(id -u)" == "0" ]] || sudo="sudo -n"
        { $sudo apt-get update -qq && $sudo apt-get install -y -qq chromium chromium-driver libjemalloc2 gcc; } \
            || echo "scripts/test.sh: could not install chromium, libjemalloc2 and gcc (needs root): their tests will skip" >&2
    fi
fi
python3 -m venv .venv && . .venv/bin/activate && pip install -q "torch==2.13.0" -e ".[test]" && python -m pytest "$@"
