"""Loading a user's reward file: the function, and a clear error for each way it goes wrong."""

from pathlib import Path

import pytest

from hybridflow.rewards.custom import load_reward_function


def _write(directory: Path, name: str, source: str) -> str:
    path = directory / name
    path.write_text(source)
    return str(path)


def test_loads_the_named_function_and_calls_it_with_verls_keywords(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "reward.py",
        "def my_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str == ground_truth),\n"
        "            'source': data_source, 'info': extra_info}\n",
    )
    fn = load_reward_function(path, "my_score")
    result = fn(data_source="d", solution_str="a", ground_truth="a", extra_info={"k": 1})
    assert result == {"score": 1.0, "source": "d", "info": {"k": 1}}


def test_an_async_reward_function_is_run_to_completion(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "async_reward.py",
        "import asyncio\n"
        "async def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    await asyncio.sleep(0)\n"
        "    return 0.5\n",
    )
    fn = load_reward_function(path, "compute_score")
    assert fn(data_source="d", solution_str="a", ground_truth="b", extra_info=None) == 0.5


def test_two_files_with_the_same_name_do_not_replace_each_other(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    source = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return {}\n"
    first = load_reward_function(_write(tmp_path / "a", "reward.py", source.replace("{}", "1.0")))
    second = load_reward_function(_write(tmp_path / "b", "reward.py", source.replace("{}", "2.0")))
    assert first(data_source="", solution_str="", ground_truth="", extra_info=None) == 1.0
    assert second(data_source="", solution_str="", ground_truth="", extra_info=None) == 2.0


def test_a_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.py"
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_reward_function(str(missing), "compute_score")


def test_a_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    source = "import math\n\ndef compute_score(data_source, solution_str:\n    return 1\n"
    path = _write(tmp_path, "broken.py", source)
    with pytest.raises(SyntaxError) as info:
        load_reward_function(path, "compute_score")
    assert f"{path}:3:" in str(info.value)
    assert info.value.filename == path and info.value.lineno == 3


def test_an_error_while_importing_the_file_names_the_file_and_keeps_the_cause(tmp_path: Path) -> None:
    path = _write(tmp_path, "raises.py", "import json\nraise RuntimeError('no config here')\n")
    with pytest.raises(ImportError, match="raises.py.*RuntimeError: no config here") as info:
        load_reward_function(path, "compute_score")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_sys_exit_while_importing_is_an_import_error_not_an_exit(tmp_path: Path) -> None:
    path = _write(tmp_path, "exits.py", "import sys\nsys.exit(2)\n")
    with pytest.raises(ImportError, match="SystemExit"):
        load_reward_function(path, "compute_score")


def test_a_missing_function_lists_what_the_file_defines(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "other.py",
        "def score_it(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
        "def _private():\n    pass\n",
    )
    with pytest.raises(AttributeError, match=r"defines no 'compute_score'.*\['score_it'\]"):
        load_reward_function(path, "compute_score")


def test_a_name_that_is_not_a_function_is_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path, "constant.py", "compute_score = 3\n")
    with pytest.raises(TypeError, match="is a int, not a function"):
        load_reward_function(path, "compute_score")


def test_a_function_that_cannot_take_the_four_keywords_is_rejected_at_load(tmp_path: Path) -> None:
    path = _write(tmp_path, "narrow.py", "def compute_score(solution_str, ground_truth):\n    return 1.0\n")
    with pytest.raises(TypeError, match="cannot be called as compute_score\\(data_source="):
        load_reward_function(path, "compute_score")
