"""verl's whole trainer config tree is classified: every key of it (tests/data/verl_config_keys.tsv,
regenerated from a verl checkout by scripts/verl_config_keys.py) is honoured, an alias, ignored with
a reason, or refused in one line saying what hybridflow does instead; never an unknown key."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from hybridflow.config import ConfigError, load_config, schema_keys
from hybridflow.config import aliases
from hybridflow.config.aliases import IGNORED, KEYS, translate_key, translate_mapping
from hybridflow.config.verl_keys import NULL_IS_UNSET, RULES, rule_for
from hybridflow.config.verl_table import _is_mapping_leaf, classify, verl_keys_markdown

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
from verl_config_keys import KEYS_TSV, read_tsv  # noqa: E402

ROWS = read_tsv(KEYS_TSV)
DOCS = ROOT / "docs" / "verl_keys.md"

# hybridflow keys being added by the "knobs behind verl's frequent keys" work (issue 32, item 5), whose
# verl spellings reach them by the aliases and prefixes already; an entry goes once its key exists.
PENDING: set[str] = set()

VALUE_REFUSED = {
    # Keys honoured here whose verl *default* is refused by the value check, and why that is right.
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns":
        "verl's null is unbounded; hybridflow bounds an episode (default 5)",
}


@pytest.fixture(autouse=True, scope="module")
def _notes_stay_unsaid():
    """translate_key notes each key once per process; walking 700 keys here must not use up the
    notes other tests look for (test_config_aliases reads the quickstart's)."""
    saved = set(aliases._noted_keys)
    yield
    aliases._noted_keys.clear()
    aliases._noted_keys.update(saved)


def _pending(target: str) -> bool:
    return any(target == p or target.startswith(f"{p}.") for p in PENDING)


def _cli(default_json: str) -> str:
    value = json.loads(default_json)
    if isinstance(value, str):
        # Quoted where Hydra's grammar would read a character otherwise (~, $, spaces, braces).
        return value if re.fullmatch(r"[A-Za-z0-9_./-]*", value) else "'" + value.replace("'", "\\'") + "'"
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def _load(key: str, value: str) -> None:
    """``key=value`` through the loader; a key the override grammar cannot spell (nsys options are
    named with dashes) goes through the YAML path, which takes any key."""
    if "-" in key:
        ours = translate_key(key, yaml.safe_load(value))
        if ours is not None:
            load_config(overrides=[f"{ours}={value}"])
        return
    load_config(overrides=[f"{key}={value}"])


def test_the_key_list_is_verls_whole_tree():
    keys = {row[0] for row in ROWS}
    assert len(keys) > 650  # both generated trees, the legacy data config and the examples' extra keys
    for key in ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size", "data.return_raw_chat",
                "critic.model.fsdp_config.param_offload", "reward_model.reward_kwargs.overlong_buffer_cfg.len",
                "global_profiler.tool", "actor_rollout_ref.rollout.enable_chunked_prefill"):
        assert key in keys, key


def test_every_key_is_classified():
    leaves = set(schema_keys())
    unclassified = []
    for key, *_ in ROWS:
        c = classify(key, leaves)
        if c.status == "unclassified" and not _pending(c.target or ""):
            unclassified.append(f"{key} (-> {c.target})")
        if c.status in ("honoured", "alias"):
            assert c.target in leaves or _pending(c.target) or any(
                c.target.startswith(f"{p}.") for p in PENDING) or any(  # an entry of a mapping leaf
                c.target.startswith(f"{leaf}.") and _is_mapping_leaf(leaf) for leaf in leaves), \
                f"{key} -> {c.target} is not a schema key"
    assert not unclassified, "verl keys with no classification:\n" + "\n".join(unclassified)


def test_no_rule_shadows_a_hybridflow_key():
    """A rule for verl's spelling must never catch hybridflow's own key of the same name."""
    for key in schema_keys():
        assert rule_for(key) is None, f"{key} is a hybridflow key, yet {rule_for(key)[0]} catches it"
        assert key not in IGNORED and key not in KEYS, key
    for pattern in RULES:
        assert pattern not in KEYS and pattern not in IGNORED, pattern


def test_pending_targets_are_still_missing():
    """Once a pending key exists, take it out of PENDING so the strict checks cover it."""
    now_there = sorted(p for p in PENDING if p in set(schema_keys()))
    if now_there:
        pytest.skip(f"exist now, drop from PENDING: {', '.join(now_there)}")


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r[0]}[{r[2]}]")
def test_verls_default_value_gets_its_classification(row):
    """Each key set to verl's default: honoured, alias and ignored keys load (or are refused by the
    value check for a reason in VALUE_REFUSED); refused keys raise a one-line ConfigError naming the
    key; a key accepted only at verl's default loads at it."""
    key, default, source, _expr = row
    c = classify(key)
    if c.status == "unclassified" or (c.target and _pending(c.target)):
        pytest.skip(f"{key} waits for {c.target}")
    if not default or json.loads(default) == "???":
        value = "1"  # a key verl's examples set (no default in the tree), or verl's mandatory rollout.name
        if c.status in ("honoured", "alias", "ignored"):
            return  # its target's own type check applies; nothing verl-specific to check
    else:
        value = _cli(default)
    override = f"{key}={value}"
    rule = rule_for(key)
    must_refuse = c.status == "refused" or (c.status == "conditional" and not rule[1].accepted(value))
    if must_refuse:
        with pytest.raises(ConfigError) as info:
            _load(key, value)
        message = str(info.value)
        assert "\n" not in message and key in message and info.value.key == key, message
        return
    try:
        _load(key, value)
    except ConfigError as exc:
        assert key in VALUE_REFUSED, f"{override}: {exc}"


def test_megatron_keys_name_megatron_and_fsdp2():
    megatron = [row for row in ROWS if ".megatron." in row[0] or row[2] == "megatron"]
    assert len(megatron) > 60
    for key, default, _source, _ in megatron:
        c = classify(key)
        if c.status != "refused" and ".megatron." not in key:
            continue  # a key of both trees whose Megatron default differs (strategy: checked below)
        assert c.status == "refused", key
        with pytest.raises(ConfigError, match="Megatron") as info:
            load_config(overrides=[f"{key}={_cli(default) if default else 1}"])
        assert "FSDP2" in str(info.value), key
    for role_key in ("actor_rollout_ref.actor.strategy", "critic.strategy", "actor_rollout_ref.ref.strategy"):
        with pytest.raises(ConfigError, match="hybridflow trains with FSDP2, not Megatron"):
            load_config(overrides=[f"{role_key}=megatron"])
        load_config(overrides=[f"{role_key}=fsdp2"])  # FSDP2 is what runs here


def test_refusals_say_what_hybridflow_does_instead():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.megatron\.tensor_model_parallel_size.*"
                                          r"actor\.ulysses_sequence_parallel_size"):
        load_config(overrides=["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"])
    with pytest.raises(ConfigError, match=r"data\.train_max_samples=1000 .*accepted: -1"):
        load_config(overrides=["data.train_max_samples=1000"])
    load_config(overrides=["data.train_max_samples=-1"])  # verl's default: every row, as here
    with pytest.raises(ConfigError, match="not supported here"):
        translate_key("data.train_max_samples")  # no value: refused, not silently dropped


def test_aliases_and_null_defaults_land_where_they_mean():
    cfg = load_config(overrides=[
        "critic.model.fsdp_config.param_offload=True", "critic.model.use_remove_padding=False",
        "actor_rollout_ref.actor.tau_pos=2.0", "actor_rollout_ref.actor.optim.clip_grad=0.5",
        "reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "reward_model.reward_kwargs.overlong_buffer_cfg.len=64",
        "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null", "data.val_batch_size=null",
        "data.trust_remote_code=False", "actor_rollout_ref.rollout.response_length=48",
    ])
    assert cfg.data.max_response_length == 48 and cfg.model.trust_remote_code is False  # false: verl's default
    assert load_config(overrides=["data.trust_remote_code=True"]).model.trust_remote_code  # true: the model's key
    assert cfg.critic.fsdp_config.param_offload and not cfg.critic.use_remove_padding
    assert cfg.actor.policy_loss.tau_pos == 2.0 and cfg.actor.grad_clip == 0.5
    assert (cfg.reward.overlong_buffer.enable, cfg.reward.overlong_buffer.len,
            cfg.reward.overlong_buffer.penalty_factor) == (True, 64, 0.5)
    defaults = load_config()
    assert cfg.actor.ppo_micro_batch_size_per_gpu == defaults.actor.ppo_micro_batch_size_per_gpu
    assert cfg.data.val_batch_size == defaults.data.val_batch_size
    assert set(NULL_IS_UNSET) <= {row[0] for row in ROWS}


def test_a_verl_yaml_tree_is_judged_value_by_value():
    """translate_mapping (a YAML file) passes each leaf's value: verl's defaults of conditional keys
    load, a changed one is refused, and Hydra's _target_ naming verl's own class is accepted."""
    tree = {"actor_rollout_ref": {"actor": {"_target_": "verl.workers.config.FSDPActorConfig",
                                            "checkpoint": {"save_contents": ["model", "optimizer", "extra"]},
                                            "fsdp_config": {"offload_policy": False, "param_offload": True}}},
            "data": {"train_max_samples": -1, "dataloader_num_workers": 8}}
    assert translate_mapping(tree) == {"actor": {"fsdp_config": {"param_offload": True}}}
    tree["data"]["train_max_samples"] = 10
    with pytest.raises(ConfigError, match="data.train_max_samples=10"):
        translate_mapping(tree)
    with pytest.raises(ConfigError, match="Python class"):
        translate_mapping({"critic": {"_target_": "my_pkg.MyCritic"}})


def test_docs_verl_keys_md_is_up_to_date():
    assert DOCS.read_text(encoding="utf-8") == verl_keys_markdown(ROWS), (
        "docs/verl_keys.md is out of date; regenerate it with `python scripts/verl_config_keys.py --table "
        "docs/verl_keys.md`"
    )


def test_verls_global_micro_batch_is_divided_over_the_data_parallel_ranks():
    """verl's deprecated global micro-batches become per-rank counts as verl's workers divide them:
    by the ranks over the role's Ulysses size (the reference's is the actor's unless set), never by
    rollout.n; the reward model's by the ranks alone."""
    cfg = load_config(overrides=[
        "actor_rollout_ref.actor.ppo_micro_batch_size=176", "trainer.n_gpus_per_node=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size=16", "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.ref.log_prob_micro_batch_size=32", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "critic.ppo_micro_batch_size=16", "critic.forward_micro_batch_size=48", "reward_model.micro_batch_size=64",
        "trainer.nnodes=2",  # after the micro-batches: the rank count is the final one's
    ])
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 176 // 8  # 16 ranks / sp 2
    assert cfg.actor.log_prob_micro_batch_size_per_gpu == 2 and cfg.ref.log_prob_micro_batch_size_per_gpu == 4
    assert cfg.critic.ppo_micro_batch_size_per_gpu == 1 and cfg.critic.forward_micro_batch_size_per_gpu == 3
    assert cfg.reward_model.micro_batch_size_per_gpu == 4
    # One rank: the global count is the per-rank one (verl's 1-GPU LoRA tuning scripts).
    one = load_config(overrides=["actor_rollout_ref.actor.ppo_micro_batch_size=62", "trainer.n_gpus_per_node=1"])
    assert one.actor.ppo_micro_batch_size_per_gpu == 62
    # verl's null (its default) keeps hybridflow's per-rank value.
    assert load_config(overrides=["actor_rollout_ref.actor.ppo_micro_batch_size=null"]).actor \
        .ppo_micro_batch_size_per_gpu == load_config().actor.ppo_micro_batch_size_per_gpu
    assert classify("critic.ppo_micro_batch_size").target == "critic.ppo_micro_batch_size_per_gpu"


@pytest.mark.parametrize("overrides, match", [
    (["actor_rollout_ref.actor.ppo_micro_batch_size=10", "trainer.n_gpus_per_node=4"],
     r"ppo_micro_batch_size=10 .*4 data-parallel ranks.*verl would floor it to 2"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size=2", "trainer.n_gpus_per_node=4"], r"does not divide by 4"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"],
     r"both set the micro-batch"),
    (["critic.ppo_micro_batch_size=many"], r"positive integer"),
])
def test_a_global_micro_batch_that_does_not_divide_is_refused_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_config(overrides=overrides)
    assert info.value.key == overrides[0].split("=")[0]


def test_a_global_micro_batch_in_a_yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    ppo_micro_batch_size: 32\ntrainer:\n  n_gpus_per_node: 4\n")
    assert load_config(config_file=path).actor.ppo_micro_batch_size_per_gpu == 8
    with pytest.raises(ConfigError, match="only a whole config"):
        translate_key("actor_rollout_ref.actor.ppo_micro_batch_size", 32)


def test_keys_verl_declares_but_never_reads_are_accepted_as_verl_runs_them():
    """over_sample_rate (no verl code reads it: every request completes) and the SGLang server-mode
    YAML's sglang_rollout_mode / server.* load at any value and change nothing."""
    cfg = load_config(overrides=["actor_rollout_ref.rollout.over_sample_rate=0.1",
                                 "actor_rollout_ref.rollout.sglang_rollout_mode=server",
                                 "actor_rollout_ref.rollout.server.timeout=60"])
    assert cfg == load_config(overrides=["actor_rollout_ref.hybrid_engine=true"])  # verl's default is ours


def test_verls_hybrid_engine_key_sets_ours():
    """actor_rollout_ref.hybrid_engine is trainer.hybrid_engine's verl spelling: true in every verl
    config (and here by default), false a process per rank of each role on Ray."""
    assert load_config(overrides=["actor_rollout_ref.hybrid_engine=true"]).trainer.hybrid_engine
    assert not load_config(overrides=["actor_rollout_ref.hybrid_engine=false"]).trainer.hybrid_engine
    with pytest.raises(ConfigError, match="data.train_files"):
        load_config(overrides=["data.custom_cls.path=my/dataset.py"])
