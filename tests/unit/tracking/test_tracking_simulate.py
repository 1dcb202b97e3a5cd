"""The pipeline simulator with hand-worked cases: constant lengths gain only the overlap, a long
tail keeps sync waiting, staleness 0 is sync on split devices, and a run folder calibrates it."""

from __future__ import annotations

import json
import math

import pytest

from hybridflow.cli import main
from hybridflow.tracking.simulate import (
    Costs, LengthModel, generate_batch, predict, profile_from_run, replica_makespan, simulate_fully_async,
    simulate_one_step_off, simulate_sync,
)

# 4 samples of 100 tokens per step, 10 ms per decode iteration: generation 1.0 s on any replica that
# holds them all at once; training 1 ms per token per device; scoring 0.5 s; weight sync 0.5 s.
CONSTANT = LengthModel(empirical=(100,))
COSTS = Costs(decode_s_per_token=0.01, slots=4, train_s_per_token=0.001, reward_s=0.5, weight_sync_s=0.5,
              prompt_tokens=0, batch=4)


def test_continuous_batching_on_one_replica():
    assert replica_makespan([10, 10, 10], slots=2, decode_s=1.0, overhead_s=0.0) == 20.0  # third waits for a slot
    assert replica_makespan([100, 1, 1, 1], slots=2, decode_s=1.0, overhead_s=0.0) == 100.0  # short ones refill
    assert replica_makespan([10, 10], slots=4, decode_s=1.0, overhead_s=2.0) == 12.0
    gen, used = generate_batch([1000, 10, 10, 10], replicas=2, c=Costs(decode_s_per_token=0.01, slots=4))
    assert gen == pytest.approx(10.0) and used == pytest.approx(10.3)  # replica 0 holds the long one


def test_sync_is_the_sum_of_its_phases():
    # 2 devices: 2 replicas generate (1.0 s), score (0.5), train 400 tokens on 2 devices (0.2), sync (0.5).
    p = simulate_sync(2, CONSTANT, COSTS, steps=3)
    assert p.step_s == pytest.approx(2.2)
    assert p.trainer_idle == pytest.approx(1 - 1.2 / 2.2)


def test_constant_lengths_one_step_off_gains_the_overlap_only():
    # 1 device generates (1.0 s), 1 trains (0.5 + 0.4): max(1.0, 0.9) + 0.5 per step after warm-up.
    p = simulate_one_step_off(2, 1, CONSTANT, COSTS, steps=5)
    assert p.step_s == pytest.approx(1.5)


def test_constant_lengths_fully_async_is_no_better_than_one_step_off():
    assert simulate_fully_async(2, 1, 1, CONSTANT, COSTS, steps=5).step_s == pytest.approx(1.5)
    # Staleness 0: the next batch starts after the sync; nothing overlaps: 1.0 + 0.9 + 0.5.
    assert simulate_fully_async(2, 1, 0, CONSTANT, COSTS, steps=5).step_s == pytest.approx(2.4)


def test_a_long_tail_keeps_sync_waiting_and_async_fills_the_slots():
    # One sample in ten is 10x longer: sync generation lasts as long as the longest of each batch.
    tail = LengthModel(empirical=(100,) * 9 + (1000,))
    c = Costs(decode_s_per_token=0.01, slots=64, train_s_per_token=1e-5, weight_sync_s=0.1, prompt_tokens=0, batch=64)
    sync = simulate_sync(8, tail, c, steps=10)
    assert sync.step_s == pytest.approx(10.0 + 0.1 + 1e-5 * 64 * 190 / 8, rel=0.05)  # a 1000 in every batch
    assert sync.rollout_idle > 0.9  # 64 slots x 8 replicas mostly empty while the tail decodes
    fast = simulate_fully_async(8, 4, 2, tail, c, steps=10)
    assert fast.step_s < sync.step_s / 3
    assert fast.rollout_idle < sync.rollout_idle


def test_predict_reports_every_mode_and_the_speedup():
    rows = predict([2, 4], [1, 2], CONSTANT, COSTS, steps=3)
    assert [(r.mode, r.devices, r.staleness) for r in rows] == [
        ("sync", 2, None), ("one_step_off", 2, 1), ("fully_async", 2, 1), ("fully_async", 2, 2),
        ("sync", 4, None), ("one_step_off", 4, 1), ("fully_async", 4, 1), ("fully_async", 4, 2),
    ]
    for r in rows:
        sync = next(s for s in rows if s.mode == "sync" and s.devices == r.devices)
        assert r.speedup == pytest.approx(sync.step_s / r.step_s)
        assert r.rollout_devices + r.trainer_devices == r.devices or r.mode == "sync"
    assert predict([1], [1], CONSTANT, COSTS, steps=2)[0].mode == "sync"  # one device: no split loops


def test_lognormal_from_mean_and_max_keeps_the_mean():
    model = LengthModel.from_mean_and_max(500.0, 3000.0, batch=512, cap=4096)
    assert math.exp(model.mu + model.sigma ** 2 / 2) == pytest.approx(500.0)
    assert 0.3 < model.sigma < 1.5
    assert LengthModel.from_mean_and_max(100.0, 100.0, batch=8, cap=100).sigma == pytest.approx(0.0)


def write_run(folder, steps: int = 3) -> None:
    # 4 samples of 100 prompt + 100 response tokens; the phases of a sync step add up to the step.
    record = {"timing_s/gen": 2.0, "timing_s/reward": 0.3, "timing_s/update_actor": 0.8,
              "timing_s/update_weights": 0.1, "timing_s/step": 3.2, "response_length/mean": 100.0,
              "response_length/max": 100, "prompt_length/mean": 100.0, "perf/total_num_tokens": 800}
    lines = [json.dumps({"step": 0, "val/score/mean": 0.1})]
    lines += [json.dumps({"step": s, **record}) for s in range(1, steps + 1)]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n{\"step\": 9, \"timing")  # a killed writer's line


def test_a_run_folder_calibrates_the_model_to_reproduce_its_own_step(tmp_path):
    write_run(tmp_path)
    profile = profile_from_run(tmp_path)
    c = profile.costs
    assert profile.steps == 3 and c.batch == 4 and c.prompt_tokens == 100.0
    assert c.decode_s_per_token == pytest.approx(0.02)  # 2.0 s over 100 decode iterations
    assert (c.train_s_per_token, c.reward_s, c.weight_sync_s) == pytest.approx((0.001, 0.3, 0.1))
    assert simulate_sync(1, profile.lengths, c, steps=3).step_s == pytest.approx(3.2)


def test_cli_simulate_from_flags_and_from_a_run(tmp_path, capsys):
    assert main(["simulate", "--devices", "4", "--staleness", "1", "--steps", "3", "--batch", "16",
                 "--length-mean", "200", "--length-cap", "1000"]) == 0
    out = capsys.readouterr().out
    assert "sync" in out and "one_step_off" in out and "fully_async s=1" in out and "speed-up" in out
    write_run(tmp_path)
    assert main(["simulate", str(tmp_path), "--devices", "2", "--staleness", "2", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "batch 4 samples" in out and "fully_async s=2" in out


def test_cli_simulate_takes_the_runs_shape_from_its_config(tmp_path, capsys):
    from hybridflow.config import config_to_yaml, load_config

    write_run(tmp_path)
    cfg = load_config("grpo", None, ["rollout.max_batch_size=8", "trainer.n_workers=2"])
    (tmp_path / "config.yaml").write_text(config_to_yaml(cfg))
    assert main(["simulate", str(tmp_path), "--devices", "2", "--staleness", "1", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "(2 replica(s) x 8 slots)" in out and "on 2 device(s)" in out
