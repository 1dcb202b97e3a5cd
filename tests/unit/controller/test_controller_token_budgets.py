"""Token budgets derived from free memory are recorded at a run's first start and read back by every
later start in the same folder (hybridflow/controller/token_budgets.py): a resume beside another
load cuts its micro-batches as the run it continues did."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from hybridflow.config import load_config
from hybridflow.controller.setup import build_run
from hybridflow.controller import token_budgets
from hybridflow.controller.token_budgets import (
    DTYPE_KEY,
    KV_CACHE_KEY,
    THREADS_KEY,
    TOKEN_BUDGETS_FILE,
    apply_recorded_budgets,
    automatic_budget_keys,
)
from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model
from hybridflow.workers.actor import ActorWorker
from hybridflow.workers.reference import ReferenceWorker

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("budgets")
    model_dir = write_tiny_model(root / "model")
    train, val = write_arithmetic_task(root / "data", train_size=8, val_size=2)
    return model_dir, train, val


def config(files, out, *extra):
    model_dir, train, val = files
    return load_config("grpo", overrides=[
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"trainer.output_dir={out}", "trainer.logger=[jsonl]", "trainer.progress_bar=false", "trainer.num_threads=1",
        "trainer.timeline=false", "data.max_response_length=4", "actor.use_kl_loss=true", "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4", "rollout.n=2", *extra,
    ])


def budgets_of(run) -> dict[str, tuple]:
    return {"actor": run.roles.actor.call_all(ActorWorker.token_budgets)[0],
            "reference": run.roles.reference.call_all(ReferenceWorker.token_budgets)[0]}


def test_a_later_start_in_the_folder_cuts_batches_by_the_recorded_budgets(files, tmp_path):
    out = tmp_path / "run"
    fp32 = "model.dtype=float32"  # the record then holds the budgets alone (auto records its dtype too)
    run = build_run(config(files, out, fp32))
    try:
        first = budgets_of(run)
        kv_cache = run.roles.rollout.kv_cache_budget()
    finally:
        run.close()
    record = json.loads((out / TOKEN_BUDGETS_FILE).read_text())
    assert record["budgets"] == {"actor.ppo_max_token_len_per_gpu": first["actor"][0],
                                 "actor.log_prob_max_token_len_per_gpu": first["actor"][1],
                                 "ref.log_prob_max_token_len_per_gpu": first["reference"][1],
                                 KV_CACHE_KEY: kv_cache}
    # Another start in the folder, where free memory would now give other budgets: the record's
    # are the ones used. (Edited here to stand for that difference; nothing else sets them.)
    record["budgets"] = {key: value // 2 for key, value in record["budgets"].items()}
    (out / TOKEN_BUDGETS_FILE).write_text(json.dumps(record))
    run = build_run(config(files, out, fp32))
    try:
        again = budgets_of(run)
    finally:
        run.close()
    assert again["actor"] == (first["actor"][0] // 2, first["actor"][1] // 2)
    assert again["reference"][1] == first["reference"][1] // 2
    written = yaml.safe_load((out / "config.yaml").read_text())  # the config the run says it ran with
    assert written["actor"]["ppo_max_token_len_per_gpu"] == first["actor"][0] // 2


def test_budgets_the_user_sets_are_kept_and_never_recorded(files, tmp_path):
    out = tmp_path / "run"
    (out).mkdir()
    (out / TOKEN_BUDGETS_FILE).write_text(json.dumps({"budgets": {"actor.ppo_max_token_len_per_gpu": 99}}))
    cfg = config(files, out, "actor.ppo_max_token_len_per_gpu=200")
    assert apply_recorded_budgets(cfg, out) == []
    assert cfg.actor.ppo_max_token_len_per_gpu == 200
    assert "actor.ppo_max_token_len_per_gpu" not in automatic_budget_keys(cfg)
    fixed = automatic_budget_keys(config(files, out, "actor.use_dynamic_bsz=false"))  # sample-count micro-batches
    assert not {key for key in fixed if key.startswith(("actor.", "ref."))}, fixed


def test_a_damaged_record_is_an_error_naming_the_file(files, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / TOKEN_BUDGETS_FILE).write_text('{"budgets": {"actor.ppo_max_token_len_per_gpu": "lots"}}')
    with pytest.raises(ValueError, match=rf"{TOKEN_BUDGETS_FILE} is damaged .*delete it to derive them again"):
        apply_recorded_budgets(config(files, out), out)


def test_a_resume_on_a_machine_with_less_free_memory_decodes_with_the_recorded_kv_cache_budget(
        files, tmp_path, monkeypatch):
    from hybridflow.inference import native

    def engine(run):
        return run.roles.rollout.groups[0]._workers[0].engine

    first_budget = 64 << 20  # 64 MiB: 128 rows of 256 positions (2 KiB each for this model), 64 of them prompt rows
    out = tmp_path / "run"
    monkeypatch.setattr(native, "default_kv_cache_bytes", lambda device: first_budget)
    run = build_run(config(files, out))
    try:
        rows = engine(run)._runner.cache.rows_that_fit(256)
        assert engine(run).kv_cache_memory_bytes == first_budget
    finally:
        run.close()
    assert json.loads((out / TOKEN_BUDGETS_FILE).read_text())["budgets"][KV_CACHE_KEY] == first_budget
    # The resume's machine has a quarter less memory free: derived again, the budget would hold 32
    # decode rows of 256 positions instead of 64.
    monkeypatch.setattr(native, "default_kv_cache_bytes", lambda device: first_budget * 3 // 4)
    run = build_run(config(files, out))
    try:
        assert engine(run).kv_cache_memory_bytes == first_budget
        assert engine(run)._runner.cache.rows_that_fit(256) == rows == 64
    finally:
        run.close()
    written = yaml.safe_load((out / "config.yaml").read_text())
    assert written["rollout"]["kv_cache_memory_bytes"] == first_budget


def test_a_kv_cache_budget_the_user_sets_is_used_and_never_recorded(files, tmp_path):
    out = tmp_path / "run"
    cfg = config(files, out, "rollout.kv_cache_memory_bytes=33554432")
    assert KV_CACHE_KEY not in automatic_budget_keys(cfg)
    run = build_run(cfg)
    try:
        assert run.roles.rollout.groups[0]._workers[0].engine.kv_cache_memory_bytes == 33554432
    finally:
        run.close()
    assert KV_CACHE_KEY not in json.loads((out / TOKEN_BUDGETS_FILE).read_text())["budgets"]


def threads_during_set_up(cfg) -> int:
    """torch's thread count while the run is set up (and after it closes, the test's one thread again)."""
    run = build_run(cfg)
    try:
        return torch.get_num_threads()
    finally:
        run.close()
        torch.set_num_threads(1)


def test_threads_left_unset_are_decided_by_the_rule_recorded_and_read_back_by_a_resume(files, tmp_path, monkeypatch):
    """The thread count changes float rounding: unset, the first start takes the machine's rule and
    records it; a resume on a machine whose rule now says otherwise (more cores) keeps the count."""
    out = tmp_path / "run"
    monkeypatch.setattr(token_budgets, "rule_threads", lambda ranks_sharing: 1)
    assert threads_during_set_up(config(files, out, "trainer.num_threads=null")) == 1
    assert json.loads((out / TOKEN_BUDGETS_FILE).read_text())["budgets"][THREADS_KEY] == 1
    assert yaml.safe_load((out / "config.yaml").read_text())["trainer"]["num_threads"] == 1
    monkeypatch.setattr(token_budgets, "rule_threads", lambda ranks_sharing: 2)  # the resume's machine
    assert threads_during_set_up(config(files, out, "trainer.num_threads=null")) == 1
    # A fresh folder on that machine takes its rule: the record, not the rule, made the resume's 1.
    assert threads_during_set_up(config(files, tmp_path / "fresh", "trainer.num_threads=null")) == 2


def test_threads_the_user_sets_or_follow_are_never_recorded(files, tmp_path):
    out = tmp_path / "run"
    assert threads_during_set_up(config(files, out, "trainer.num_threads=2")) == 2
    assert THREADS_KEY not in json.loads((out / TOKEN_BUDGETS_FILE).read_text())["budgets"]
    out = tmp_path / "follow"
    run = build_run(config(files, out, "trainer.num_threads=follow"))
    try:
        from hybridflow.utils import threads

        assert threads._governor is not None and threads._governor.follow
    finally:
        run.close()
        torch.set_num_threads(1)
    assert THREADS_KEY not in json.loads((out / TOKEN_BUDGETS_FILE).read_text())["budgets"]
    assert yaml.safe_load((out / "config.yaml").read_text())["trainer"]["num_threads"] == "follow"


def actor_compute_dtype(cfg) -> torch.dtype | None:
    """The actor engine's autocast dtype once the run is set up (None: float32 compute)."""
    run = build_run(cfg)
    try:
        return run.roles.actor.call_all(lambda worker: worker.engine.autocast_dtype)[0]
    finally:
        run.close()
        torch.set_num_threads(1)


def test_model_dtype_auto_is_decided_by_the_rule_recorded_and_read_back_by_a_resume(files, tmp_path, monkeypatch):
    """model.dtype=auto: the first start takes the hardware's rule (bf16-mixed where it has bf16) and
    records it; a resume on a CPU without bf16 hardware keeps computing in bf16; float32 opts out."""
    out = tmp_path / "run"
    monkeypatch.setattr(token_budgets, "rule_train_dtype", lambda device_type: ("bfloat16", "bf16 hardware"))
    assert actor_compute_dtype(config(files, out, "model.dtype=auto")) == torch.bfloat16
    assert json.loads((out / TOKEN_BUDGETS_FILE).read_text())["budgets"][DTYPE_KEY] == "bfloat16"
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["dtype"] == "bfloat16"
    monkeypatch.setattr(token_budgets, "rule_train_dtype", lambda device_type: ("float32", "no bf16 hardware"))
    assert actor_compute_dtype(config(files, out, "model.dtype=auto")) == torch.bfloat16  # the resume
    assert actor_compute_dtype(config(files, tmp_path / "fresh", "model.dtype=auto")) is None
    opted_out = tmp_path / "float32"
    assert actor_compute_dtype(config(files, opted_out, "model.dtype=float32")) is None
    assert DTYPE_KEY not in json.loads((opted_out / TOKEN_BUDGETS_FILE).read_text())["budgets"]


def test_a_recorded_dtype_that_is_no_dtype_is_an_error_naming_the_file(tmp_path):
    (tmp_path / TOKEN_BUDGETS_FILE).write_text(json.dumps({"budgets": {DTYPE_KEY: "float8"}}))
    with pytest.raises(ValueError, match=TOKEN_BUDGETS_FILE):
        token_budgets.read_budgets(tmp_path)
