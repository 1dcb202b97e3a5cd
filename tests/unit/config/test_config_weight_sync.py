"""rollout.weight_sync: a typed key with named choices; ``auto`` broadcasts exactly when the rollout
runs in another process than actor rank 0 (trainer.backend=ray), and ``broadcast`` in-process is a
ConfigError naming the key, raised before any model loads."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, load_config, validate_config
from hybridflow.config.schema import RolloutConfig
from hybridflow.controller.roles import resolve_weight_sync
from hybridflow.controller.setup import build_run


def test_the_key_defaults_to_auto_and_accepts_its_choices() -> None:
    assert RolloutConfig().weight_sync == "auto"
    for mode in ("auto", "object_store", "broadcast"):
        assert load_config("grpo", overrides=[f"rollout.weight_sync={mode}"]).rollout.weight_sync == mode


def test_a_bad_value_names_the_key_and_the_choices() -> None:
    with pytest.raises(ConfigError) as info:
        load_config("grpo", overrides=["rollout.weight_sync=broadcasts"])
    message = str(info.value)
    assert "'rollout.weight_sync' is 'broadcasts'" in message
    assert "auto, object_store, broadcast" in message and "did you mean 'broadcast'" in message
    assert info.value.key == "rollout.weight_sync"


@pytest.mark.parametrize(
    ("mode", "backend", "resolved"),
    [
        ("auto", "local", "object_store"),  # one process: the direct copy
        ("auto", "ray", "broadcast"),  # the rollout is another process than actor rank 0
        ("object_store", "ray", "object_store"),
        ("object_store", "local", "object_store"),
        ("broadcast", "ray", "broadcast"),
    ],
)
def test_auto_broadcasts_only_across_processes(mode: str, backend: str, resolved: str) -> None:
    assert resolve_weight_sync(mode, backend) == resolved


def test_broadcast_in_process_is_an_error_naming_the_key_before_any_model_loads(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"rollout.weight_sync=broadcast .* trainer.backend=local") as info:
        resolve_weight_sync("broadcast", "local")
    assert info.value.key == "rollout.weight_sync"
    # build_run refuses it among the config checks, before the output folder or a model exists.
    cfg = load_config("grpo", overrides=["rollout.weight_sync=broadcast", f"trainer.output_dir={tmp_path / 'out'}"])
    with pytest.raises(ConfigError, match="rollout.weight_sync=broadcast"):
        build_run(cfg)
    assert not (tmp_path / "out").exists()


def test_the_hybrid_engine_hands_weights_over_beside_each_actor_rank_and_a_broadcast_keeps_a_process_per_rank() -> None:
    """trainer.hybrid_engine: ``auto`` resolves to the hand-over in each shared process; a broadcast, whose two
    sides must run at once, cannot run in a process that runs one call at a time: asked for by name, it keeps
    a process per rank (config explain names it), and a shared process is never handed one."""
    from hybridflow.config.explain import explain_config
    from hybridflow.config.layout import shares_processes

    assert resolve_weight_sync("auto", "ray", shared_processes=True) == "beside"
    assert resolve_weight_sync("object_store", "ray", shared_processes=True) == "object_store"
    with pytest.raises(ConfigError, match="trainer.hybrid_engine=true puts each replica") as info:
        resolve_weight_sync("broadcast", "ray", shared_processes=True)
    assert info.value.key == "rollout.weight_sync"
    cfg = load_config("grpo", overrides=["rollout.weight_sync=broadcast", "trainer.backend=ray", "trainer.n_workers=2",
                                         "trainer.hybrid_engine=true"])
    assert validate_config(cfg) == [] and not shares_processes(cfg)
    assert resolve_weight_sync(cfg.rollout.weight_sync, "ray", shares_processes(cfg)) == "broadcast"
    assert ("processes: one per rank of each role: trainer.hybrid_engine=true does not apply here "
            "(rollout.weight_sync=broadcast streams the weights to each replica's own process)") in explain_config(cfg)
