"""What runs inside the sandbox for the code reward (``code.py``): the two harness programs (assert tests,
stdin/stdout tests) and the value codec both sides share. ``encode_value`` and ``decode_value`` also
run in the sandbox (the harness carries their source), so they use nothing but builtins and the
modules they import."""

from __future__ import annotations

import functools
import inspect
import json
import sys
from typing import Any


# One reported value (its JSON line) and the items in it: a list of ten thousand numbers fits;
# a value past either is reported as an error rather than filling the output cap.
MAX_VALUE_CHARS = 1 << 17


MAX_VALUE_ITEMS = 1 << 15


MAX_VALUE_DEPTH = 100


def encode_value(value: Any, max_items: int = MAX_VALUE_ITEMS, max_depth: int = MAX_VALUE_DEPTH) -> Any:
    """``value`` as JSON-ready data that keeps Python's types apart (a tuple is not a list).

    Only exact built-in types qualify, checked with ``type(x) is ...``: ``json.dumps`` would
    write a subclass of ``int`` or ``str`` as its base value and iterate a subclass of ``list``
    natively, and a subclass's ``__eq__`` or ``__repr__`` may say anything, so a subclass is
    refused like any other object. Built-in iterators (generators, ``map``, ``zip``, ...) are
    drained; ``Counter``, ``OrderedDict`` and ``defaultdict`` travel as the dicts they compare as.

    Raises:
        TypeError: the value holds something that is not plain data.
        ValueError: it holds more than ``max_items`` items or nests deeper than ``max_depth``.
    """
    import collections
    import types

    iterators = (
        types.GeneratorType, map, filter, zip, enumerate, reversed,
        type(iter([])), type(reversed([])), type(iter(())), type(iter("")), type(iter(b"")),
        type(iter(range(0))), type(iter(set())), type(iter({})), type(iter({}.values())), type(iter({}.items())),
        type(iter(int, 0)),
    )
    mappings = (dict, collections.Counter, collections.OrderedDict, collections.defaultdict)
    sequences = ((list, "list"), (tuple, "tuple"), (set, "set"), (frozenset, "frozenset"))
    left = [max_items]

    def walk(item: Any, depth: int) -> Any:
        left[0] -= 1
        if left[0] < 0 or depth > max_depth:
            raise ValueError("value too large or too deeply nested to report")
        kind = type(item)
        if item is None or kind is bool or kind is str or kind is float:
            return item  # json writes nan and infinities as NaN and Infinity, and reads them back
        if kind is int:
            # Past Python's 4300-digit limit for decimal text, hex has none.
            return item if item.bit_length() <= 4096 else {"int": format(item, "x")}
        if kind is complex:
            return {"complex": [item.real, item.imag]}
        if kind is bytes:
            return {"bytes": item.hex()}
        if kind is range:
            return {"range": [item.start, item.stop, item.step]}
        for sequence, tag in sequences:  # by identity: a metaclass can make a class == list
            if kind is sequence:
                return {tag: [walk(element, depth + 1) for element in item]}
        if any(kind is mapping for mapping in mappings):
            return {"dict": [[walk(key, depth + 1), walk(element, depth + 1)] for key, element in item.items()]}
        if any(kind is iterator for iterator in iterators):
            return {"iter": [walk(element, depth + 1) for element in item]}
        raise TypeError(f"{kind.__module__}.{kind.__qualname__} is not plain data")

    return walk(value, 0)


def decode_value(data: Any, max_depth: int = MAX_VALUE_DEPTH, max_range: int | None = None) -> Any:
    """The value ``encode_value`` encoded, built from scratch out of built-in types. ``data``
    is untrusted: anything but a well-formed encoding raises ``ValueError``, and so does a
    ``range`` longer than ``max_range`` (a claimed ``range(10**18)`` would stall ``sum``)."""

    def number(item: Any) -> bool:
        return type(item) is int or type(item) is float

    def build(item: Any, depth: int) -> Any:
        if depth > max_depth:
            raise ValueError("encoded value nests too deeply")
        kind = type(item)
        if item is None or kind is bool or kind is int or kind is float or kind is str:
            return item
        if kind is dict and len(item) == 1:
            ((tag, body),) = item.items()
            if tag == "int" and type(body) is str:
                return int(body, 16)
            if tag == "bytes" and type(body) is str:
                return bytes.fromhex(body)
            if tag == "complex" and type(body) is list and len(body) == 2 and all(map(number, body)):
                return complex(body[0], body[1])
            if tag == "range" and type(body) is list and len(body) == 3 and all(type(x) is int for x in body):
                value = range(body[0], body[1], body[2])
                if max_range is None or len(value) <= max_range:
                    return value
            if tag == "dict" and type(body) is list:
                pairs = [pair for pair in body if type(pair) is list and len(pair) == 2]
                if len(pairs) == len(body):
                    return {build(key, depth + 1): build(element, depth + 1) for key, element in pairs}
            if tag in ("list", "tuple", "set", "frozenset", "iter") and type(body) is list:
                elements = [build(element, depth + 1) for element in body]
                return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset, "iter": iter}[tag](elements)
        raise ValueError(f"not an encoded value: {str(item)[:80]!r}")

    try:
        return build(data, 0)
    except (TypeError, RecursionError) as error:  # an unhashable key or element, say
        raise ValueError(f"not an encoded value: {error}") from None


# Runs in the sandbox. Reads its steps from stdin before the solution runs (they hold no
# expected value), reports on a copy of stdout while the solution's own prints go to /dev/null
# (a chatty solution neither fills the output cap nor writes over reports), one JSON line per
# step as it goes, so a later test that hangs does not lose earlier results.
_ASSERT_HARNESS = r'''
from __future__ import annotations
import json, os, signal, sys

{codec}

class _Timeout(BaseException):
    pass

def _main():
    spec = json.loads(sys.stdin.readline())
    report_fd = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    write, dumps, encode, decode = os.write, json.dumps, encode_value, decode_value
    limit, timeout = spec["max_value_chars"], spec["case_timeout_s"]
    armed = [False]

    def alarm(signum, frame):
        if armed[0]:
            raise _Timeout()

    def timed(run, *args):
        signal.signal(signal.SIGALRM, alarm)
        armed[0] = True
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            return run(*args)
        except BaseException:
            return False
        finally:
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)

    def report(ident, ok, value=None):
        item = {{"id": ident, "ok": ok}}
        if ok and value is not None:
            item["value"] = value[0]
        line = dumps(item)
        if len(line) > limit:
            line = dumps({{"id": ident, "ok": False}})
        write(report_fd, (line + "\n").encode())

    def load():
        exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
        return True

    def test(steps):
        for ident, kind, *args in steps:
            try:
                if kind == "bind":
                    namespace[args[0]] = decode(args[1])
                elif kind == "exec":
                    exec(compile(args[0], f"test_step_{{ident}}", "exec"), namespace)
                    report(ident, True)
                else:
                    value = eval(compile(args[0], f"test_step_{{ident}}", "eval"), namespace)
                    report(ident, True, [encode(value)])
            except _Timeout:
                raise
            except BaseException:
                report(ident, False)
                if kind != "eval":  # a setup step failed: the rest of this test cannot run
                    return False
        return True

    namespace = {{"__name__": "__main__"}}
    if timed(load):
        for steps in spec["tests"]:
            timed(test, steps)
    os._exit(0)  # not waiting for threads or atexit handlers the solution left behind

_main()
'''


STDIO_HARNESS = r'''
import ctypes, json, os, subprocess, sys

def _main():
    spec = json.loads(sys.stdin.readline())
    # Not dumpable: the solution's processes (same user) cannot read or trace this one, and
    # they do not hold its stdout: only this process reports.
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    limit = spec["max_output_chars"]
    for index, case_input in enumerate(spec["inputs"]):
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-B", "solution.py"], input=case_input.encode(),
                capture_output=True, timeout=spec["case_timeout_s"],
            )
            status = "ok" if done.returncode == 0 else "error"
            stdout = done.stdout.decode(errors="replace")[:limit]
        except subprocess.TimeoutExpired:
            status, stdout = "timeout", ""
        except OSError:
            status, stdout = "error", ""
        line = json.dumps({"id": index, "ok": status == "ok", "status": status, "stdout": stdout})
        os.write(1, f"{line}\n".encode())

_main()
'''


@functools.cache
def harness_source() -> str:
    codec = "\n\n".join(inspect.getsource(function) for function in (encode_value, decode_value))
    limits = f"MAX_VALUE_ITEMS = {MAX_VALUE_ITEMS}\nMAX_VALUE_DEPTH = {MAX_VALUE_DEPTH}\n"  # the defaults' values
    return _ASSERT_HARNESS.format(codec=limits + codec)
