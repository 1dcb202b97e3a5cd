"""``hybridflow sft``'s refusals: one line and exit code 2 before any training starts."""

from __future__ import annotations

import json

import pytest

from hybridflow.cli import main


@pytest.mark.parametrize(("args", "message"), [
    ([], "config error: hybridflow sft needs data.train_files"),
    (["data.train_files=x.parquet", "trainer.save_final=false"], "config error: sft.export=true exports the final"),
    (["data.train_files=x.parquet", "trainer.n_workers=3", "data.train_batch_size=32"],
     "config error: data.train_batch_size=32 examples per step do not split over 3 ranks"),
])
def test_config_mistakes_are_one_line(args, message, capsys, tmp_path):
    assert main(["sft", f"trainer.output_dir={tmp_path / 'run'}", *args]) == 2
    assert capsys.readouterr().err.startswith(message)
    assert not (tmp_path / "run").exists()


def test_a_row_without_the_columns_is_a_data_error_naming_file_and_row(capsys, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
                    + "\n" + json.dumps({"conversation": []}) + "\n")
    code = main(["sft", f"data.train_files={data}", "warm_start.enable=false", f"trainer.output_dir={tmp_path / 'run'}",
                 f"warm_start.cache_dir={tmp_path / 'cache'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"data error: {data} row 1 (line 2): no column 'messages'" in err and "'conversation'" in err


def test_sft_help_does_not_offer_the_rl_presets(capsys):
    """The RL presets (grpo, ppo, dapo, ...) set nothing SFT reads: sft --help does not list them."""
    from hybridflow.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["sft", "--help"])
    help_text = capsys.readouterr().out
    assert "--preset" not in help_text and "dapo" not in help_text
    assert build_parser().parse_args(["sft", "data.train_files=[a.jsonl]"]).preset is None
