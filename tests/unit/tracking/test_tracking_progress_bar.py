"""Log records printed while the training bar is shown start on a line of their own."""

from __future__ import annotations

import io
import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from hybridflow.tracking.loggers import ProgressBar

FORMAT = "%(levelname)s %(name)s: %(message)s"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def rendered_lines(text: str) -> list[str]:
    """What a terminal shows for ``text``: ``\\r`` returns to the start of the line and later
    characters overwrite earlier ones."""
    lines = []
    for raw in ANSI.sub("", text).split("\n"):
        cells: list[str] = []
        for segment in raw.split("\r"):
            for column, char in enumerate(segment):
                if column < len(cells):
                    cells[column] = char
                else:
                    cells.append(char)
        lines.append("".join(cells).rstrip())
    return [line for line in lines if line]


@contextmanager
def console_logging() -> Iterator[logging.Handler]:
    """The CLI's set-up: a root handler on stderr, INFO and up. Made inside the test, so that
    its stream is capsys's stand-in for stderr (a fixture's set-up runs under another capture)."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        root.handlers, root.level = saved


def console_handlers() -> list[logging.Handler]:
    """The root's handlers besides pytest's own (capture, live logging)."""
    return [h for h in logging.getLogger().handlers if not type(h).__module__.startswith("_pytest")]


def test_a_record_logged_under_the_bar_gets_its_own_line(capsys):
    log = logging.getLogger("hybridflow.test")
    with console_logging() as handler:
        bar = ProgressBar(3, enabled=True)
        bar.update(1, {"score": 0.5})
        log.info("validation at step 1: val/score/mean 0.250")
        log.warning("step 2: health/truncation: %d%% of responses hit data.max_response_length", 75)
        bar.update(2, {"score": 0.6})
        bar.close()
        assert console_handlers() == [handler]  # put back when the bar closes
    err = capsys.readouterr().err
    lines = rendered_lines(err)
    assert "INFO hybridflow.test: validation at step 1: val/score/mean 0.250" in lines, lines
    assert "WARNING hybridflow.test: step 2: health/truncation: 75% of responses hit data.max_response_length" in lines
    assert not [line for line in lines if "training" in line and "hybridflow.test" in line], lines


def test_a_disabled_bar_leaves_logging_alone():
    with console_logging() as handler:
        bar = ProgressBar(3, enabled=False)
        assert console_handlers() == [handler]
        bar.close()
        assert console_handlers() == [handler]


def test_levels_and_other_handlers_are_kept(tmp_path, capsys):
    root = logging.getLogger()
    with console_logging() as handler:
        handler.setLevel(logging.WARNING)
        to_file = logging.FileHandler(tmp_path / "log.txt")
        root.addHandler(to_file)
        with ProgressBar(2, enabled=True):
            assert to_file in root.handlers and handler not in root.handlers
            logging.getLogger("hybridflow.test").info("below the console's level")
            logging.getLogger("hybridflow.test").warning("above it")
        assert console_handlers() == [handler, to_file]
        to_file.close()
    err = capsys.readouterr().err
    assert "above it" in err and "below the console's level" not in err
    assert "below the console's level" in (tmp_path / "log.txt").read_text()


def test_the_runs_bar_is_drawn_only_where_stderr_is_a_terminal(monkeypatch):
    """A redirected log (a file, a pipe) gets no carriage-return redraws; a terminal gets the bar."""
    import os

    for stream, drawn in ((io.StringIO(), False), (None, True)):
        if stream is None:
            leader, follower = os.openpty()
            stream = os.fdopen(follower, "w")
        monkeypatch.setattr(sys, "stderr", stream)
        bar = ProgressBar.for_console(3, enabled=True)
        assert (bar.step is not None) == drawn
        bar.close()
    assert ProgressBar.for_console(3, enabled=False).step is None
    stream.close()
    os.close(leader)
