"""The ``hybridflow`` console command: the memory allocator is chosen (``utils.allocator``) before
anything heavy is imported, then the command line runs (``cli.main``)."""

from __future__ import annotations

from hybridflow.utils.allocator import choose_allocator


def main() -> int:
    choose_allocator()
    from hybridflow.cli import main as run_command_line

    return run_command_line()
