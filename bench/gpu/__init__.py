"""The GPU kit's checks, one module a step (scripts/gpu_checks.py runs each in its own process and
time box). Every step also runs on a CPU with ``--dry-run``: the same code at toy sizes, so a broken
import or API drift is found on this machine, not in the lent GPU's minutes."""
