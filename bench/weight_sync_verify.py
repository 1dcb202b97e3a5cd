"""What the weight-sync verifier (``rollout.verify_weight_sync``) costs next to the sync it checks.

Two native-engine rollout replicas in this process (``RolloutReplicas`` over local worker groups,
the path a colocated run takes) receive a ~18M-parameter Qwen2-shaped model's fp32 weights through
``RolloutReplicas.update_weights``, once with the verifier off and once on; medians over
``--repeats`` syncs after a warm-up, per rollout dtype (bfloat16 adds the sender-side cast the
checksums are taken in). Printed: sync seconds without and with the check, the check's own
seconds (``timing_s/verify_weight_sync``) and its ratio to the unchecked sync.

    python bench/weight_sync_verify.py --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

import torch

from hybridflow.cluster.worker_group import LocalWorkerGroup
from hybridflow.controller.replicas import RolloutReplicas, replica_role
from hybridflow.models.loading import load_causal_lm
from hybridflow.models.tiny import TinyModelSpec, write_tiny_model
from hybridflow.workers.rollout import RolloutSetup, RolloutWorker

# The ~20M shape of bench/weight_sync.py, with the built-in tokenizer's vocabulary.
SPEC = TinyModelSpec(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                     num_key_value_heads=2, max_position_embeddings=1024)


def _builder(setup: RolloutSetup):
    return lambda rank, world_size: RolloutWorker(rank, world_size, setup)


def build_replicas(model_dir: str, count: int, dtype: str, verify: bool) -> RolloutReplicas:
    setup = RolloutSetup(model_path=model_dir, engine="native", dtype=dtype, device=torch.device("cpu"),
                         max_batch_size=8, seed=0, kv_cache_memory_bytes=16 * 1024 * 1024)
    groups = [LocalWorkerGroup(replica_role(k), _builder(dataclasses.replace(setup, name=replica_role(k))))
              for k in range(count)]
    return RolloutReplicas(groups, free_cache_engine=False, verify_weight_sync=verify)


def timed(replicas: RolloutReplicas, weights: dict[str, torch.Tensor], repeats: int) -> tuple[float, float]:
    """Median seconds of a whole sync and of its check (0 when off), after one warm-up."""
    syncs, checks = [], []
    for i in range(repeats + 1):
        start = time.perf_counter()
        replicas.update_weights(weights.items(), version=i + 1)
        elapsed = time.perf_counter() - start
        check = replicas.take_sync_metrics().get("timing_s/verify_weight_sync", 0.0)
        if i:
            syncs.append(elapsed)
            checks.append(check)
    return statistics.median(syncs), statistics.median(checks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_tiny_model(tmp, SPEC, seed=0))
        weights = {name: t + 0.01 for name, t in load_causal_lm(model_dir).state_dict().items()}
        mb = sum(t.numel() * t.element_size() for t in weights.values()) / 2**20
        print(f"{sum(t.numel() for t in weights.values()) / 1e6:.1f}M parameters ({mb:.0f} MiB fp32), "
              f"{args.replicas} replicas, {args.threads} threads, median of {args.repeats}")
        print(f"{'dtype':<10}{'sync_off_s':>12}{'sync_on_s':>12}{'verify_s':>12}{'verify/sync':>13}{'on/off':>9}")
        for dtype in args.dtype:
            off, _ = timed(build_replicas(model_dir, args.replicas, dtype, verify=False), weights, args.repeats)
            on, check = timed(build_replicas(model_dir, args.replicas, dtype, verify=True), weights, args.repeats)
            print(f"{dtype:<10}{off:>12.4f}{on:>12.4f}{check:>12.4f}{check / off:>12.1%}{on / off:>9.3f}")


if __name__ == "__main__":
    main()
