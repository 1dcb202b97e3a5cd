"""actor.use_torch_compile: the training engine's decoder layers compiled (same losses and logprobs as
eager), and a compile that fails goes back to eager with one warning, redoing the work it spoiled."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch

from hybridflow.algorithms import agg_loss, batch_counts
from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.training import compile as layer_compile
from hybridflow.training import engine as engine_module
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.types import collate_trajectories

from test_training_engine import sampled_trajectories

SPEC = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1)


@pytest.fixture(scope="module", autouse=True)
def threads():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_and_batch():
    model = build_tiny_model(SPEC, seed=4)
    return model, collate_trajectories(sampled_trajectories(model, temperature=1.0), pad_token_id=256)


def train_twice(engine: TrainEngine, batch, packed: bool) -> tuple[list[float], torch.Tensor]:
    """Two optimizer steps, then the logprobs of the batch: what compiling must leave unchanged."""
    num_tokens, _ = batch_counts(batch.response_mask)

    def loss_fn(mb, logprobs, entropy):
        loss = agg_loss(-logprobs, mb.response_mask, "token-mean", global_num_tokens=num_tokens)
        return loss, {"loss": float(loss)}

    losses = [engine.optimizer_step(batch.split(6), loss_fn, temperature=1.0, with_entropy=False,
                                    use_remove_padding=packed)["loss"] for _ in range(2)]
    logprobs, _ = engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=6, use_remove_padding=packed)
    return losses, logprobs


def failing_backend(graph_module, example_inputs):
    raise RuntimeError("this backend cannot compile anything")


def test_a_failing_compile_falls_back_to_eager_with_one_warning(model_and_batch, monkeypatch, caplog):
    model, batch = model_and_batch
    monkeypatch.setattr(engine_module, "LayerCompiler", functools.partial(layer_compile.LayerCompiler,
                                                                         backend=failing_backend))
    eager = train_twice(TrainEngine(copy.deepcopy(model), OptimSpec(lr=1e-2), torch.device("cpu")), batch, True)
    engine = TrainEngine(copy.deepcopy(model), OptimSpec(lr=1e-2), torch.device("cpu"), compile_layers=True)
    with caplog.at_level(logging.WARNING, logger="hybridflow.training.compile"):
        fallen = train_twice(engine, batch, True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "actor.use_torch_compile=true: torch.compile failed" in warnings[0]
    assert not engine.compiler.active
    assert fallen[0] == pytest.approx(eager[0], abs=1e-6)  # the failed step was redone whole, not doubled
    torch.testing.assert_close(fallen[1], eager[1])


@pytest.mark.slow
def test_compiled_layers_train_as_eager_does(model_and_batch):
    """Inductor for real (compiling a forward and a backward: tens of seconds on a CPU): two optimizer steps
    on the whole batch give the same losses and the same weights as eager."""
    model, batch = model_and_batch
    num_tokens, _ = batch_counts(batch.response_mask)

    def two_steps(engine: TrainEngine) -> list[float]:
        def loss_fn(mb, logprobs, entropy):
            loss = agg_loss(-logprobs, mb.response_mask, "token-mean", global_num_tokens=num_tokens)
            return loss, {"loss": float(loss)}

        return [engine.optimizer_step([batch], loss_fn, temperature=1.0, with_entropy=False)["loss"]
                for _ in range(2)]

    eager = TrainEngine(copy.deepcopy(model), OptimSpec(lr=1e-2), torch.device("cpu"))
    compiled = TrainEngine(copy.deepcopy(model), OptimSpec(lr=1e-2), torch.device("cpu"), compile_layers=True)
    eager_losses, compiled_losses = two_steps(eager), two_steps(compiled)
    assert compiled.compiler.active  # it compiled, it did not fall back
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-4)
    for (name, a), b in zip(eager.model.named_parameters(), compiled.model.parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4, msg=name)


def test_the_config_turns_it_on_for_the_actor_and_the_reference(tmp_path):
    from hybridflow.config import load_config
    from hybridflow.controller.setup import build_run
    from hybridflow.models.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "model", SPEC, seed=0)
    cfg = load_config("grpo", overrides=[
        f"model.path={model_dir}", f"trainer.output_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]",
        "trainer.progress_bar=false", "trainer.num_threads=1", "trainer.timeline=false", "actor.use_kl_loss=true",
        "actor_rollout_ref.actor.use_torch_compile=true",  # verl's spelling
    ])
    run = build_run(cfg)
    try:
        actor, reference = run.roles.actor._workers[0], run.roles.reference._workers[0]
        assert actor.engine.compiler is not None and reference.engine.compiler is not None
        assert len(actor.engine.compiler.layers) == SPEC.num_hidden_layers
    finally:
        run.close()
