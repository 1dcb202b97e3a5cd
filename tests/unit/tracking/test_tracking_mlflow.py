"""trainer.logger=mlflow: a real local MLflow store (mlflow-skinny's file store), read back through MLflow's
own client."""

from __future__ import annotations

import json

import pytest

from hybridflow.tracking.loggers import Generation, Tracker, flatten_params, mlflow_metric_key

mlflow = pytest.importorskip("mlflow", reason="the mlflow extra is not installed (pip install 'hybridflow[mlflow]')")
from mlflow.tracking import MlflowClient  # noqa: E402


@pytest.fixture(autouse=True)
def no_mlflow_environment(monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def only_run(store):
    client = MlflowClient(tracking_uri=store.as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name != "Default"]
    (run,) = client.search_runs([experiment.experiment_id])
    return client, experiment, run


def test_metrics_params_and_generations_land_in_a_local_store(tmp_path):
    config = {"actor": {"optim": {"lr": 1e-6}}, "trainer": {"logger": ["mlflow"]}}
    with Tracker(["mlflow"], output_dir=tmp_path / "run", project="proj", experiment="exp", config=config) as t:
        t.log({"critic/score/mean": 0.25, "val-core/src/acc/mean@4": 0.5}, step=1)
        t.log({"critic/score/mean": 0.75}, step=2)
        t.log_generations([Generation("2 + 2 =", "4", 1.0)], step=2)
    client, experiment, run = only_run(tmp_path / "run" / "mlruns")
    assert experiment.name == "proj" and run.info.run_name == "exp" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.75)]
    assert run.data.metrics["val-core/src/acc/mean_at_4"] == 0.5  # MLflow refuses '@' in a key
    assert run.data.params == {"actor/optim/lr": "1e-06", "trainer/logger": '["mlflow"]'}
    path = client.download_artifacts(run.info.run_id, "val_generations/step_2.json", str(tmp_path))
    assert json.loads(open(path).read()) == {"step": 2, "samples": [{"input": "2 + 2 =", "output": "4", "score": 1.0}]}


def test_mlflow_tracking_uri_chooses_the_store(tmp_path, monkeypatch):
    store = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    with Tracker(["mlflow"], output_dir=tmp_path / "run", project="p", experiment="e", config={}) as t:
        t.log({"x": 1.0}, step=0)
    assert not (tmp_path / "run" / "mlruns").exists()
    assert only_run(store)[2].data.metrics == {"x": 1.0}


def test_keys_and_params_are_spelled_as_mlflow_takes_them():
    assert mlflow_metric_key("val-core/a b/acc/best@2/mean") == "val-core/a b/acc/best_at_2/mean"
    assert mlflow_metric_key("x//y#z") == "x/y_z"
    assert flatten_params({"a": {"b": [1, 2], "c": None, "d": "text"}, "e": {}}) == {
        "a/b": "[1, 2]", "a/c": "null", "a/d": "text", "e": "{}"}


def test_a_short_run_logs_its_metrics_to_mlflow(tmp_path):
    from hybridflow import api
    from hybridflow.data.tasks.arithmetic import write_arithmetic_task
    from hybridflow.models.tiny import TinyModelSpec, write_tiny_model

    model = write_tiny_model(tmp_path / "model", TinyModelSpec(hidden_size=32, intermediate_size=64,
                                                               num_hidden_layers=1, num_attention_heads=2,
                                                               num_key_value_heads=1))
    train, val = write_arithmetic_task(tmp_path / "data", train_size=16, val_size=4)
    run_dir = tmp_path / "run"
    api.train(api.make_config(overrides=[
        f"model.path={model}", f"data.train_files={train}", f"data.val_files={val}", "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4", "rollout.n=2", "data.max_response_length=4", "trainer.total_training_steps=2",
        "trainer.num_threads=1", "trainer.progress_bar=false", "trainer.logger=[mlflow]", "trainer.timeline=false",
        "trainer.log_val_generations=2", f"trainer.output_dir={run_dir}", "trainer.experiment_name=mlflow-run",
    ]))
    client, _, run = only_run(run_dir / "mlruns")
    assert run.info.run_name == "mlflow-run" and run.info.status == "FINISHED"
    scores = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert [m.step for m in scores] == [1, 2]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/score/mean")] == [0, 2]
    assert any(key.startswith("val-core/") and "_at_" in key for key in run.data.metrics)  # '@' spelled out
    assert run.data.params["rollout/n"] == "2"
    assert {a.path for a in client.list_artifacts(run.info.run_id, "val_generations")} == {
        "val_generations/step_0.json", "val_generations/step_2.json"}
