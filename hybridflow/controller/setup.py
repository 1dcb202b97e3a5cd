"""Everything a run needs before its first step, built from the config in a fixed order:

1. validate the config and resolve every registry name (fails in well under a second, before
   any model loads),
2. resolve the built-in model and task into ordinary files on disk,
3. load data, build the sampler and the step plan,
4. start the worker groups (actor, rollout, reference when a KL term needs it, critic when the
   estimator needs values, reward, reward model when ``reward_model.enable``): in this
   process (``trainer.backend=local``) or as Ray actors (``ray``), where the actor and
   reference ranks each form a torch.distributed group and rollout replica r shares bundle r
   with actor rank r; with ``rollout.weight_sync`` resolving to broadcast, actor rank 0 and the
   rollout replicas form the weight-sync group,
5. open the loggers.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridflow.agents import build_tool_parser, load_tools
from hybridflow.agents.base import agent_loop_class, agent_name_of
from hybridflow.agents.interactions import load_interaction_config
from hybridflow.agents.openai_agent import load_agent_function
from hybridflow.algorithms import (
    build_estimator_params,
    estimator_needs,
    get_adv_estimator,
    get_kl_controller,
    get_policy_loss,
)
from hybridflow.cluster.ray_group import Placement, ResourcePool
from hybridflow.cluster.backends import build_worker_group, reserve_placements, runs_in_process
from hybridflow.cluster.worker_group import WorkerError, WorkerGroup, meeting_host, wait_all
from hybridflow.config import Config, ConfigError, config_to_dict, config_to_yaml, validate_config
from hybridflow.config.errors import MachineProblem, raise_all
from hybridflow.config.schema import CriticConfig, DataConfig, MultiTurnConfig, WarmStartConfig
from hybridflow.config.budget import VISUAL_BUILTIN_TASKS
from hybridflow.config.validate import TOOL_TASKS, data_parallel_size, rollout_replicas, sequence_parallel_sizes
from hybridflow.config.explain import BUILTIN_TINY, needs_reference_model, planned_total_steps, warm_start_decision
from hybridflow.controller.replicas import RolloutReplicas, replica_role
from hybridflow.controller.rollout_dtype import resolve_run_rollout_dtype
from hybridflow.controller.run_folder import lock_run_folder, write_placement
from hybridflow.controller.token_budgets import apply_recorded_budgets, automatic_budget_keys, record_budgets
from hybridflow.controller.sft import SFTPair, SFTSpec, SFTStage, prepare_builtin_model, prepare_builtin_vl_model
from hybridflow.data import PromptRow, RLDataset
from hybridflow.data.sampler import PromptSampler
from hybridflow.data.sampler_plugin import SamplerError, build_prompt_sampler, named_sampler_class
from hybridflow.data.dataset import DataError, check_chat_template_kwargs
from hybridflow.data.tasks.arithmetic import arithmetic_sft_pairs, make_arithmetic_rows, write_arithmetic_task
from hybridflow.data.tasks.calculator import (
    MIXED_STAGE_LR_SCALE,
    TOOL_ONLY_SHARE,
    calculator_warm_start,
    make_calculator_rows,
    write_calculator_task,
)
from hybridflow.data.tasks.colour_square import write_colour_square_task
from hybridflow.models.loading import (
    VL_MODEL_TYPES,
    check_model_dir,
    check_sequence_classifier,
    load_model_config,
    load_tokenizer,
)
from hybridflow.models.vision import is_vision_language, load_vision_processor
from hybridflow.rewards.judge import JudgeSettings
from hybridflow.rewards.registry import known_data_sources
from hybridflow.rollout.factory import ROLLOUT_ENGINES, VL_ROLLOUT_ENGINE, engine_model_problem, engine_unavailable
from hybridflow.rewards.manager import scoring_processes
from hybridflow.rewards.sandbox_fusion import SandboxFusionSettings
from hybridflow.rewards.sandbox_fusion import build_settings as build_sandbox_fusion_settings
from hybridflow.rewards.shaping import overlong_buffer_end, resolve_overlong_buffer
from hybridflow.tracking import ProgressBar, Tracker
from hybridflow.tracking.loggers import missing_logger_packages
from hybridflow.tracking.timeline import TIMELINE_FILENAME, Timeline
from hybridflow.types import TrainBatch
from hybridflow.utils.device import configure_threads, resolve_device
from hybridflow.utils.seed import seed_everything
from hybridflow.utils.storage import Storage, StorageError, is_remote
from hybridflow.utils.threads import stop_following
from hybridflow.workers.actor import ActorSetup, ActorWorker, build_actor_policy_loss, rollout_rs_criteria
from hybridflow.workers.critic import CriticSetup, CriticWorker
from hybridflow.workers.reference import ReferenceSetup, ReferenceWorker
from hybridflow.workers.reward import RewardSetup, RewardWorker
from hybridflow.workers.reward_model import JudgeSetup, JudgeWorker, RewardModelSetup, RewardModelWorker
from hybridflow.workers.rollout import AgentSetup, RolloutSetup, RolloutWorker

log = logging.getLogger(__name__)

BUILTIN_TASK_SEED = 0
# data.builtin_task -> the writer of its train/test parquet files.
BUILTIN_TASK_WRITERS = {"arithmetic": write_arithmetic_task, "calculator": write_calculator_task,
                        "colour_square": write_colour_square_task}
# Built-in tasks whose rows have images: they need a vision-language model.path.
VISUAL_TASKS = VISUAL_BUILTIN_TASKS
# Loops that run a row in one generation, what a run without rollout.multi_turn does anyway.
SINGLE_TURN_AGENTS = frozenset({"single_turn", "single_turn_agent"})
# rollout.weight_sync, resolved (``auto`` becomes one of them).
OBJECT_STORE, BROADCAST = "object_store", "broadcast"


def resolve_weight_sync(mode: str, backend: str) -> str:
    """``rollout.weight_sync`` for ``trainer.backend``: ``auto`` broadcasts when the rollout runs in
    another process than actor rank 0, and otherwise copies in-process (``object_store``)."""
    in_process = runs_in_process(backend)
    if mode == "auto":
        return OBJECT_STORE if in_process else BROADCAST
    if mode == BROADCAST and in_process:
        # An error, not a silent fallback: the user asked for a transport that has no peer here.
        raise ConfigError(
            f"rollout.weight_sync=broadcast streams weights from actor rank 0 to the rollout process, but "
            f"trainer.backend={backend} runs both in this process, where weights are copied directly; use "
            f"rollout.weight_sync=auto, or trainer.backend=ray",
            key="rollout.weight_sync",
        )
    return mode


def connect_weight_sync(actor: WorkerGroup[ActorWorker], replicas: RolloutReplicas) -> None:
    """Form the weight-sync group: actor rank 0 sends, rollout replica k receives as member k + 1.
    Both sides join at once (each blocks until all members have), at a port on actor rank 0's node."""
    address, port = actor.rendezvous(0)
    host = meeting_host(address, replicas.node_addresses())
    gpus = [actor.call_one(0, ActorWorker.device_uuid), *replicas.device_uuids()]
    # NCCL needs every member on a GPU of its own. CPU ranks, and a replica sharing actor rank 0's
    # GPU (the colocated placement: both in bundle 0), go through host memory with gloo.
    on_gpu = None not in gpus and len(set(gpus)) == len(gpus)
    members = 1 + replicas.num_replicas
    wait_all(actor.submit_one(0, ActorWorker.join_weight_sync, host, port, members, on_gpu),
             *replicas.submit_join_weight_sync(host, port, members, on_gpu))
    log.info("weight sync: actor rank 0 -> %d rollout replica(s) by broadcast via %s:%d (%s)",
             replicas.num_replicas, host, port, "nccl" if on_gpu else "gloo")


def close_weight_sync(actor: WorkerGroup[ActorWorker], replicas: RolloutReplicas) -> None:
    """Both sides leave the weight-sync group before their processes end. Best effort: after a
    failure a torn-down group refuses calls, and its processes took their connections with them."""
    for role, close in (("actor", lambda: actor.call_one(0, ActorWorker.close_weight_sync)),
                        ("rollout", replicas.close_weight_sync)):
        try:
            close()
        except WorkerError as error:
            log.debug("weight sync: the %s could not leave the group: %s", role, error)


@dataclass
class RewardModelGroup:
    """The reward model's worker group and its role's scoring method, chosen once by
    ``reward_model.style``: ``score(trajectories) -> (scores, metrics)`` on each rank's share."""

    group: WorkerGroup[Any]
    score: Callable[..., tuple[list[float], dict[str, float]]]
    close: Callable[..., None] | None = None  # a role's own clean-up before the group closes


@dataclass
class RunSetup:
    cfg: Config
    output_dir: Path
    device: torch.device
    model_path: str
    pad_token_id: int
    train_data: RLDataset
    val_data: RLDataset | None
    sampler: PromptSampler  # the built-in seeded shuffle, or data.sampler's class
    total_steps: int
    needs_old_logprobs: bool
    adv_estimator: Any  # fn(AdvantageInputs, params) -> AdvantageOutputs
    adv_params: Any  # its frozen params, built from the algorithm section
    estimator_needs: frozenset[str]
    kl_controller: Any
    actor: WorkerGroup[ActorWorker]
    rollout: RolloutReplicas
    # The reference logprobs' group: reference ranks, or with LoRA the actor itself (both have
    # compute_ref_logprobs); None without a KL term.
    reference: WorkerGroup[ReferenceWorker] | WorkerGroup[ActorWorker] | None
    reward: WorkerGroup[RewardWorker]
    critic: WorkerGroup[CriticWorker] | None
    tracker: Tracker
    progress: ProgressBar
    tokenizer: Any  # decodes prompts and responses for the generation dumps
    # A vision-language model's processor (hybridflow.models.vision.VisionProcessor): turns a
    # row's images into its request's pixels. None for a text-only model.
    vision: Any = None
    warnings: list[str] = field(default_factory=list)
    validation_data_dir: Path | None = None  # trainer.validation_data_dir resolved (None: no dumps)
    rollout_data_dir: Path | None = None  # trainer.rollout_data_dir resolved
    pools: list[ResourcePool] = field(default_factory=list)  # Ray resources reserved (trainer, split rollout)
    weight_sync: str = OBJECT_STORE  # rollout.weight_sync resolved: object_store | broadcast (group formed)
    reward_model: RewardModelGroup | None = None  # reward_model.enable
    timeline: Timeline = field(default_factory=Timeline.disabled)  # trainer.timeline: <output_dir>/timeline.json
    storage: Storage = field(default_factory=Storage)  # how to reach s3:// and other URLs (storage.*)
    # The actor's method whose rank-0 result an object-store sync hands the rollout: its weights, or
    # only its LoRA adapter (actor.lora.sync=adapter), which the rollout workers merge themselves.
    actor_weights: Callable[[ActorWorker], list[tuple[str, torch.Tensor]]] = ActorWorker.weights_for_sync
    # The reference group's method that returns one rank's reference logprobs  # (B, R)
    reference_logprobs: Callable[[Any, TrainBatch], torch.Tensor] = ReferenceWorker.compute_ref_logprobs

    def named_groups(self) -> list[tuple[str, WorkerGroup[Any]]]:
        """Every worker group of the run, by role (each rollout replica its own)."""
        rm = self.reward_model
        named = [("actor", self.actor), ("critic", self.critic), ("reference", self.reference),
                 ("reward", self.reward), ("reward_model", rm.group if rm is not None else None)]
        named += [(replica_role(k), group) for k, group in enumerate(self.rollout.groups)]
        return [(name, group) for name, group in named if group is not None]

    def close(self) -> None:
        stop_following()  # the thread governor lives as long as the run (configure_threads)
        self.timeline.close()  # the spans after the last step (validation, the final checkpoint)
        self.progress.close()
        self.tracker.close()
        self.reward.call_all(RewardWorker.close)
        if self.weight_sync == BROADCAST:
            close_weight_sync(self.actor, self.rollout)
        self.rollout.close()
        rm = self.reward_model
        if rm is not None and rm.close is not None:
            rm.group.call_all(rm.close)
        reference = self.reference if self.reference is not self.actor else None
        groups = [self.actor, self.critic, reference, self.reward, rm.group if rm is not None else None]
        for group in groups:
            if group is not None:
                group.close()
        for pool in self.pools:
            pool.close()


def build_rollout_replicas(cfg: Config, setup: RolloutSetup, placement: Placement | None) -> RolloutReplicas:
    """``rollout_replicas(cfg)`` replicas, each a worker group of its own: replica k's
    ``rollout.tensor_model_parallel_size`` ranks in bundles from k x tp on (on Ray; the group's
    process group is the replica's tensor-parallel group), so a failing replica is named and torn
    down alone."""
    groups: list[WorkerGroup[RolloutWorker]] = []
    tp = cfg.rollout.tensor_model_parallel_size
    try:
        for k in range(rollout_replicas(cfg)):
            named = dataclasses.replace(setup, name=replica_role(k))
            groups.append(build_worker_group(cfg.trainer.backend, replica_role(k),
                                             lambda r, w, named=named: RolloutWorker(r, w, named),
                                             tp, None if placement is None else placement.from_bundle(k * tp)))
    except BaseException:
        for group in groups:  # nobody else holds the replicas started so far
            group.close()
        raise
    # The asynchronous loops generate while the actor trains: there is no idle cache to free.
    free_cache_engine = cfg.rollout.free_cache_engine and cfg.trainer.mode == "sync"
    return RolloutReplicas(groups, free_cache_engine=free_cache_engine, sleep_level=cfg.rollout.sleep_level)


def dump_dir(path: str | None, output_dir: Path) -> Path | None:
    """A generation dump folder (trainer.validation_data_dir, rollout_data_dir): a relative path is
    inside the run's folder, so a run's dumps travel with its metrics and checkpoints."""
    if not path:
        return None
    folder = Path(path).expanduser()
    return folder if folder.is_absolute() else output_dir / folder


def resolve_output_dir(cfg: Config) -> Path:
    """The run's folder, created and checked writable now (not at the first checkpoint), and locked
    for this run before anything is written in it (``run_folder.lock_run_folder``)."""
    if cfg.trainer.output_dir:
        out = Path(cfg.trainer.output_dir).expanduser()
    else:
        out = Path("runs") / f"{cfg.trainer.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}"
        cfg.trainer.output_dir = str(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock_run_folder(out)  # first: a run refused for another's lock writes nothing
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ConfigError(
            f"trainer.output_dir={str(out)!r} is not writable ({error.strerror or error}); choose a folder you can "
            f"write to", key="trainer.output_dir",
        ) from error
    return out


def remote_paths(cfg: Config) -> list[tuple[str, str, str]]:
    """(dotted key, URL, what it must be) for every object-storage URL in the config: ``file``,
    ``dir`` (must exist) or ``root`` (a folder the run writes; its bucket must exist)."""
    found = [(f"data.{key}[{i}]", url, "file") for key in ("train_files", "val_files")
             for i, url in enumerate(getattr(cfg.data, key)) if is_remote(url)]
    t = cfg.trainer
    found += [(key, url, kind) for key, url, kind in (
        ("model.path", cfg.model.path, "dir"),
        ("trainer.checkpoint_dir", t.checkpoint_dir, "root"),
        ("trainer.resume_from_path", t.resume_from_path if t.resume_mode == "path" else None, "dir"),
    ) if is_remote(url)]
    return found


def check_storage(cfg: Config, storage: Storage) -> None:
    """Reach every URL in the config now, before any model loads: missing credentials, a
    missing bucket or file fail in a second with the URL and the key, not after the download of
    a model or at the first checkpoint an hour in."""
    for key, url, kind in remote_paths(cfg):
        try:
            storage.check(url, kind)
        except StorageError as error:
            raise ConfigError(f"{key}={url}: {error}", key=key) from error
    if is_remote(cfg.trainer.output_dir):
        raise ConfigError(f"trainer.output_dir={cfg.trainer.output_dir} must be a local folder (metrics, logs and the "
                          f"staging copy of each checkpoint go there); put the URL in trainer.checkpoint_dir to keep "
                          f"the checkpoints in object storage", key="trainer.output_dir")


def fetch_model(cfg: Config, storage: Storage) -> str:
    """``model.path``, downloaded into ``storage.cache_dir`` first when it is a URL (verified,
    reused while unchanged; see ``Storage.fetch_tree``). Every loader then reads the local copy."""
    if not is_remote(cfg.model.path):
        return cfg.model.path
    try:
        local = storage.fetch_tree(cfg.model.path, cfg.storage.cache_dir)
    except (StorageError, OSError) as error:
        raise ConfigError(f"model.path={cfg.model.path}: {error}", key="model.path") from error
    log.info("model.path=%s: loading the local copy %s", cfg.model.path, local)
    return str(local)


def check_model_path(path: str) -> Path | None:
    """``model.path`` as a local model directory (None for the built-in model), checked before
    anything loads or any output is written."""
    if path == BUILTIN_TINY:
        return None
    if path.startswith("builtin:"):
        raise ConfigError(f"model.path={path!r}: the only built-in model is {BUILTIN_TINY}", key="model.path")
    try:
        return check_model_dir(path)
    except FileNotFoundError as error:
        raise ConfigError(str(error), key="model.path") from error


def check_rollout_model(path: str, engine: str, tensor_parallel_size: int = 1,
                        override_config: Mapping[str, Any] | None = None, trust_remote_code: bool = False) -> None:
    """Whether ``rollout.name=engine`` runs the architecture of ``model.path`` (on replicas of
    ``rollout.tensor_model_parallel_size`` ranks), from its
    config.json's ``model_type`` (no weight loads): an unsupported one fails now, naming the type,
    the supported ones and the engines to use instead, not after the models loaded. The built-in
    model is a supported qwen2; a missing directory is ``check_model_path``'s to report.
    ``override_config`` (model.override_config) is applied first, as every role applies it, so a
    name the model's config class lacks fails here too (config explain reports it)."""
    if path.startswith("builtin:"):
        return
    config_file = Path(path).expanduser() / "config.json"
    if not config_file.is_file():
        return
    try:
        model_config = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"model.path={path!r}: cannot read config.json ({error})", key="model.path") from error
    if override_config:
        try:
            model_config = load_model_config(path, override_config=override_config,
                                             trust_remote_code=trust_remote_code).to_dict()
        except ValueError as error:
            raise ConfigError(str(error), key="model.override_config") from error
    if model_config.get("model_type") in VL_MODEL_TYPES and engine != VL_ROLLOUT_ENGINE:
        # The native engine is text-only, and vLLM/SGLang would be handed token ids without the
        # images behind them (a silently blind policy): only the HF-forward engine takes images.
        raise ConfigError(
            f"model.path={path!r} is a {model_config['model_type']} vision-language model, which "
            f"rollout.name={engine} cannot generate from images; set rollout.name={VL_ROLLOUT_ENGINE} (the "
            "vision tower and decoding through the HF model: slow, single-request)", key="model.path",
        )
    problem = engine_model_problem(engine, model_config, tensor_parallel_size)
    if problem is not None:
        raise ConfigError(f"model.path={path!r} with rollout.name={engine}: {problem}", key="model.path")


def check_vision_language_run(cfg: Config) -> None:
    """What a vision-language ``model.path`` cannot do yet, refused before anything loads: agent
    loops (they build their own requests, without the row's images), a critic (the value model
    reads text only) and sequence parallelism (packed rows only, and image rows run padded)."""
    if cfg.model.path == BUILTIN_TINY and builtin_visual_task(cfg):
        # The built-in model of a visual task is the tiny Qwen2-VL (resolve_builtin), which only
        # the HF-forward engine runs; the checks below apply to it as to any VL model.
        if cfg.rollout.name != VL_ROLLOUT_ENGINE:
            raise ConfigError(
                f"data.builtin_task={cfg.data.builtin_task} with the built-in model trains a tiny vision-language "
                f"model, which rollout.name={cfg.rollout.name} cannot generate from images; set "
                f"rollout.name={VL_ROLLOUT_ENGINE} (or use --preset {cfg.data.builtin_task})", key="rollout.name",
            )
    elif cfg.model.path.startswith("builtin:") or not is_vision_language(cfg.model.path):
        if builtin_visual_task(cfg):
            raise ConfigError(
                f"data.builtin_task={cfg.data.builtin_task} asks about images: set model.path to a vision-language "
                f"model directory (qwen2_vl, qwen2_5_vl), or leave it {BUILTIN_TINY} for a tiny one warm-started on "
                f"the task (--preset {cfg.data.builtin_task})", key="data.builtin_task",
            )
        return
    problems = {
        "rollout.multi_turn.enable": cfg.rollout.multi_turn.enable and "agent loops do not pass images on yet",
        "algorithm.adv_estimator": config_needs_critic(cfg) and "a critic on image rows is not built",
        "actor.ulysses_sequence_parallel_size": cfg.actor.ulysses_sequence_parallel_size > 1
        and "image rows run padded, and sequence parallelism splits packed rows",
    }
    for key, problem in problems.items():
        if problem:
            raise ConfigError(f"{key}: model.path is a vision-language model and {problem}", key=key)


def builtin_visual_task(cfg: Config) -> bool:
    """Whether the run trains on a built-in task about images (no data.train_files of its own)."""
    return not cfg.data.train_files and cfg.data.builtin_task in VISUAL_TASKS


def check_critic_model_path(path: str) -> None:
    """``critic.model.path``: a local model directory (null starts from the policy's weights)."""
    if path.startswith("builtin:"):
        raise ConfigError(
            f"critic.model.path={path!r}: a critic starts from a model directory; leave it null to start from the "
            f"policy's weights (model.path, the built-in model after its warm start)", key="critic.model.path",
        )
    try:
        check_model_dir(path)
    except FileNotFoundError as error:
        raise ConfigError(f"critic.model.path: {error}", key="critic.model.path") from error


@dataclass
class WarmStartRecipe:
    """A built-in task's warm start: the first stage (``spec`` steps on ``pairs``), any later
    stages, and a key naming all of their data (for the model cache)."""

    spec: SFTSpec
    pairs: list[SFTPair]
    stages: list[SFTStage]
    pairs_key: str


def warm_start_recipe(task: str, w: WarmStartConfig, train_size: int) -> WarmStartRecipe:
    """``data.builtin_task``'s warm start with ``warm_start.*`` settings."""
    seed = BUILTIN_TASK_SEED
    if task == "calculator":
        rows = make_calculator_rows(train_size, seed, "train")
        tool_only, mixed = calculator_warm_start(rows, w.tool_call_rate)
        first = round(w.steps * TOOL_ONLY_SHARE)
        stages = [SFTStage(mixed, w.steps - first, lr=w.lr * MIXED_STAGE_LR_SCALE)] if w.steps > first else []
        key = f"calculator-train-{len(rows)}-s{seed}-tools{w.tool_call_rate}-first{TOOL_ONLY_SHARE}"
        return WarmStartRecipe(SFTSpec(steps=first, batch_size=w.batch_size, lr=w.lr, seed=seed), tool_only, stages, key)
    rows = make_arithmetic_rows(train_size, seed, "train")
    spec = SFTSpec(steps=w.steps, batch_size=w.batch_size, lr=w.lr, seed=seed, teacher_slip_rate=w.teacher_slip_rate)
    return WarmStartRecipe(spec, arithmetic_sft_pairs(rows, w.teacher_slip_rate), [], f"arithmetic-train-{len(rows)}-s{seed}")


def resolve_builtin(cfg: Config, device: torch.device, model_path: str | None = None) -> tuple[str, list[str], list[str]]:
    """(model dir, train files, val files) with ``builtin:*`` and empty data turned into files.
    ``model_path``: the model's local folder when it is not ``model.path`` itself (a download)."""
    cache = Path(cfg.warm_start.cache_dir).expanduser()
    train_files, val_files = list(cfg.data.train_files), list(cfg.data.val_files)
    d = cfg.data
    if not train_files:
        name = f"{d.builtin_task}-{d.builtin_train_size}-{d.builtin_val_size}-s{BUILTIN_TASK_SEED}"
        write = BUILTIN_TASK_WRITERS[d.builtin_task]
        train_path, val_path = write(cache / "data" / name, d.builtin_train_size, d.builtin_val_size, BUILTIN_TASK_SEED)
        train_files = [str(train_path)]
        val_files = val_files or [str(val_path)]
    model_path = model_path or cfg.model.path
    if model_path == BUILTIN_TINY and builtin_visual_task(cfg):
        warm, reason = warm_start_decision(cfg.warm_start.enable, model_path)
        log.info("built-in vision-language model: %s", reason)
        w = cfg.warm_start
        spec = SFTSpec(steps=w.steps, batch_size=w.batch_size, lr=w.lr, seed=BUILTIN_TASK_SEED) if warm else None
        model_path = str(prepare_builtin_vl_model(
            cache, train_file=Path(train_files[0]), spec=spec, device=device, max_prompt_length=d.max_prompt_length,
            data_key=f"{d.builtin_task}-train-{d.builtin_train_size}-s{BUILTIN_TASK_SEED}",
        ))
    elif model_path == BUILTIN_TINY:
        warm, reason = warm_start_decision(cfg.warm_start.enable, model_path)
        log.info("built-in model: %s", reason)
        recipe = warm_start_recipe(d.builtin_task, cfg.warm_start, d.builtin_train_size)
        model_path = str(prepare_builtin_model(
            cache, pairs=recipe.pairs, pairs_key=recipe.pairs_key, spec=recipe.spec if warm else None,
            device=device, stages=recipe.stages,
        ))
    elif model_path.startswith("builtin:"):
        raise ValueError(f"model.path={model_path!r}: the only built-in model is {BUILTIN_TINY}")
    return model_path, train_files, val_files


def agent_setup(multi_turn: MultiTurnConfig, chat_template_kwargs: Mapping[str, Any] | None = None) -> AgentSetup | None:
    """``rollout.multi_turn`` as the rollout worker's agent settings, its turns rendered with
    ``chat_template_kwargs`` (data.apply_chat_template_kwargs) as the prompts are; None when it is off."""
    mt = multi_turn
    if not mt.enable:
        return None
    return AgentSetup(
        default_agent=mt.default_agent_loop or "tool_agent",
        tool_config_path=mt.tool_config_path,
        interaction_config_path=mt.interaction_config_path,
        tool_parser=mt.format,
        max_assistant_turns=mt.max_assistant_turns,
        max_user_turns=mt.max_user_turns,
        max_parallel_calls=mt.max_parallel_calls,
        max_tool_response_length=mt.max_tool_response_length,
        tool_timeout_s=mt.tool_timeout_s,
        openai_agent=mt.openai_agent,
        openai_timeout_s=mt.openai_timeout_s,
        chat_template_kwargs=dict(chat_template_kwargs or {}),
    )


def check_agent_setup(agent: AgentSetup, data: DataConfig) -> None:
    """Resolve every name ``rollout.multi_turn`` gives (loop, parser, tools) now, before any model
    loads, and check that a built-in tool task gets its tool. Raises ``ConfigError`` naming the key."""

    def resolved(key: str, resolve: Callable[[], Any]) -> Any:
        try:
            return resolve()
        except (ValueError, TypeError, RuntimeError) as error:  # RuntimeError: no sandbox for python
            raise ConfigError(f"rollout.multi_turn.{key}: {error}") from error

    resolved("default_agent_loop", lambda: agent_loop_class(agent.default_agent))
    if agent.openai_agent is not None:
        resolved("openai_agent", lambda: load_agent_function(agent.openai_agent))
    resolved("format", lambda: build_tool_parser(agent.tool_parser))
    tools = resolved("tool_config_path", lambda: load_tools(
        agent.tool_config_path, agent.max_tool_response_length, agent.tool_timeout_s))
    if agent.interaction_config_path is not None:
        resolved("interaction_config_path", lambda: load_interaction_config(agent.interaction_config_path))
    tool = TOOL_TASKS.get(data.builtin_task)
    if tool is not None and not data.train_files and (tools is None or tool not in tools.names):
        have = ", ".join(tools.names) if tools is not None else "none"
        raise ConfigError(
            f"data.builtin_task={data.builtin_task} needs the {tool} tool, but rollout.multi_turn.tool_config_path="
            f"{agent.tool_config_path!r} gives: {have}"
        )


def check_row_agents(datasets: Iterable[RLDataset]) -> None:
    """Resolve every agent loop the rows name (``agent_name``, possibly ``module:Class``) now,
    not when a step first samples the row. Raises ``DataError`` naming the first row."""
    first_row: dict[str, str] = {}
    for data in datasets:
        for row in data:
            # The name the rollout worker will read: the row's, or one inside extra_info.
            name = agent_name_of(row.metadata(), default="")
            if name:
                first_row.setdefault(name, row.source)
    for name, source in first_row.items():
        try:
            agent_loop_class(name)
        except (ValueError, TypeError, ImportError) as error:
            raise DataError(f"{source}: agent_name {name!r}: {error}") from error


def agent_name_warning(rows: Iterable[PromptRow], multi_turn: MultiTurnConfig) -> str | None:
    """A warning when rows ask for an agent loop but the run generates single-turn."""
    if multi_turn.enable:
        return None
    named = [row.agent_name for row in rows if row.agent_name is not None and row.agent_name not in SINGLE_TURN_AGENTS]
    if not named:
        return None
    return (
        f"{len(named)} training rows name an agent loop (agent_name={named[0]!r}, ...) but "
        f"rollout.multi_turn.enable=false: they run single-turn; set rollout.multi_turn.enable=true to use it"
    )


@dataclass
class Plugins:
    """What the config's pluggable names resolved to."""

    adv_estimator: Any
    adv_params: Any
    estimator_needs: frozenset[str]
    kl_controller: Any
    agent: AgentSetup | None


@dataclass(frozen=True)
class EstimatorInputSource:
    """What the trainer runs to produce one optional estimator input, so set-up decides which
    workers and forwards a run needs from the estimator's ``needs`` without naming estimators."""

    critic: bool = False  # a critic group, whose forward gives the input
    old_logprobs: bool = False  # the actor's logprob forward before the update
    # Made by generating while the step trains: the asynchronous loops generate the next step then.
    generates: bool = False
    sum_pi_squared: bool = False  # that forward also returns Σ_v π(v)² per token (ActorSetup.sum_pi_squared)
    # Its provider reads the samples' tokens or rollout logprobs in the controller, which the
    # by-reference data plane (trainer.data_plane=refs) keeps on the replicas.
    reads_tokens: bool = False


# One entry per name in OPTIONAL_ESTIMATOR_INPUTS (a unit test keeps them equal); the loop's
# providers are in controller.phases.INPUT_PROVIDERS.
ESTIMATOR_INPUT_SOURCES: dict[str, EstimatorInputSource] = {
    "values": EstimatorInputSource(critic=True),
    "reward_baselines": EstimatorInputSource(generates=True, reads_tokens=True),  # a greedy rollout per prompt, scored
    "reward_components": EstimatorInputSource(),  # the reward's named numbers (algorithm.gdpo_reward_keys)
    "old_logprobs": EstimatorInputSource(old_logprobs=True),
    # Σ_v π(v)² per response token (verl's actor.calculate_sum_pi_squared), from the same logits
    # as the old logprobs: one forward gives both.
    "sum_pi_squared": EstimatorInputSource(old_logprobs=True, sum_pi_squared=True),
    # The rollout correction's importance weights compare that forward's logprobs with the
    # engine's. They must come from it even with one optimizer step per batch, where the actor
    # could take π_old from its update's own forward: advantages are computed before the update.
    "rollout_is_weights": EstimatorInputSource(old_logprobs=True, reads_tokens=True),
}


def _resolved(key: str, resolve: Callable[[], Any]) -> Any:
    """``resolve()``, with a registry's or an import's error turned into a ``ConfigError`` on ``key``."""
    try:
        return resolve()
    except (ValueError, KeyError, TypeError, ImportError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"{key}: {error}", key=key) from error


def needs_critic(estimator_needs: frozenset[str]) -> bool:
    """A critic is built when the advantage estimator needs its values (gae), as verl decides."""
    return any(ESTIMATOR_INPUT_SOURCES[need].critic for need in estimator_needs)


def config_needs_critic(cfg: Config) -> bool:
    """``needs_critic`` for the configured estimator, resolving only its name (``hybridflow plan``
    plans a GPU run on any machine: no device or engine check)."""
    adv_estimator = _resolved("algorithm.adv_estimator", lambda: get_adv_estimator(cfg.algorithm.adv_estimator))
    return needs_critic(_resolved("algorithm.adv_estimator", lambda: estimator_needs(adv_estimator)))


def needs_old_logprobs_for(estimator_needs: frozenset[str]) -> bool:
    """Whether an input the estimator needs comes from the actor's old-logprob forward."""
    return any(ESTIMATOR_INPUT_SOURCES[need].old_logprobs for need in estimator_needs)


def needs_sum_pi_squared_for(estimator_needs: frozenset[str]) -> bool:
    """Whether the actor's old-logprob forward must return Σπ² too."""
    return any(ESTIMATOR_INPUT_SOURCES[need].sum_pi_squared for need in estimator_needs)


def config_device(name: str) -> torch.device:
    """``trainer.device`` resolved, or a ``ConfigError`` on it (cuda without CUDA, an unknown string)."""
    try:
        return resolve_device(name)
    except (RuntimeError, ValueError) as error:
        raise ConfigError(str(error), key="trainer.device") from error


def policy_chat_template(data: DataConfig) -> str | None:
    """The chat template that replaces the policy tokenizer's (``data.chat_template`` or the file
    at ``data.chat_template_path``), or None for the tokenizer's own."""
    if data.chat_template_path is None:
        return data.chat_template
    path = Path(data.chat_template_path).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"data.chat_template_path={str(path)!r}: {error}", key="data.chat_template_path") from error


def machine_problems(cfg: Config) -> list[MachineProblem]:
    """What this machine lacks to run ``cfg``, a config that may be right for another one: no CUDA
    for trainer.device=cuda, fewer GPUs than trainer.n_gpus_per_node x trainer.nnodes, a package
    the config needs (ray, peft, the rollout engine's, httpx) not installed, an engine that needs a
    GPU. The one place that decides what is the machine's problem rather than the config's:
    ``hybridflow config explain`` lists these as "cannot run here" and exits 0; ``train`` refuses them."""
    t, problems = cfg.trainer, []

    def lack(message: str, key: str) -> None:
        problems.append(MachineProblem(message, key=key))

    cuda = torch.cuda.is_available()
    if t.device == "npu":
        # The rest of a verl NPU config is judged as it is (a CUDA cluster runs it with trainer.device=cuda).
        lack("trainer.device=npu: hybridflow has no Ascend NPU backend (torch_npu), here or on any other machine; "
             "the same config runs on CUDA GPUs with trainer.device=cuda", "trainer.device")
    elif t.device == "cuda" and not cuda:
        lack("trainer.device=cuda but CUDA is not available here (no GPU, or a CPU build of torch); use "
             "trainer.device=cpu or auto, or run on a GPU machine", "trainer.device")
    elif t.device == "cuda" and t.n_workers is None and t.ray_address is None:
        wanted, have = data_parallel_size(t), torch.cuda.device_count()
        if have < wanted:
            lack(f"trainer.n_gpus_per_node={t.n_gpus_per_node} x trainer.nnodes={t.nnodes} asks for {wanted} GPUs, "
                 f"this machine has {have}; join a Ray cluster that has them (trainer.ray_address) or ask for "
                 f"fewer", "trainer.n_gpus_per_node")
    offloaded = [f"{role}.fsdp_config.param_offload" for role in ("actor", "critic")
                 if getattr(cfg, role).fsdp_config.param_offload]
    if offloaded and t.device == "auto" and not cuda:
        # validate refuses it for trainer.device=cpu; auto is the CPU only on a machine without CUDA.
        lack(f"{offloaded[0]}=true moves parameters from the GPU to the CPU, but trainer.device=auto is the CPU "
             "here (no GPU); it runs on a GPU machine", offloaded[0])
    if t.backend == "ray" and importlib.util.find_spec("ray") is None:
        lack("trainer.backend=ray needs the ray package: pip install 'hybridflow[ray]' (or pip install ray)",
             "trainer.backend")
    lora = cfg.actor.lora
    if lora.rank > 0 and importlib.util.find_spec("peft") is None:
        lack(f"actor.lora.rank={lora.rank} needs PEFT, which is not installed: pip install 'hybridflow[lora]' "
             f"(or set actor.lora.rank=0)", "actor.lora.rank")
    if cfg.rollout.name in ROLLOUT_ENGINES:
        device = "cuda" if t.device == "cuda" or (t.device == "auto" and cuda) else "cpu"
        unavailable = engine_unavailable(cfg.rollout.name, device)
        if unavailable is not None:
            lack(f"rollout.name={cfg.rollout.name}: {unavailable}", "rollout.name")
    rm = cfg.reward_model
    if rm.enable and rm.style == "generative" and importlib.util.find_spec("httpx") is None:
        lack("reward_model.style=generative needs httpx: pip install 'hybridflow[judge]'", "reward_model.style")
    for message in missing_logger_packages(t.logger):
        lack(message, "trainer.logger")
    return problems


def resolve_plugins(cfg: Config, check_machine: bool = True) -> Plugins:
    """Resolve every name the config plugs in (registries and ``module:function`` paths, whose
    signatures are checked against the call the trainer makes), so a wrong one fails at start-up
    in well under a second, not at step 1 after the models loaded. ``config explain`` runs it too,
    with ``check_machine=False``: it lists ``machine_problems`` instead of stopping at them."""
    alg = cfg.algorithm
    adv_estimator = _resolved("algorithm.adv_estimator", lambda: get_adv_estimator(alg.adv_estimator))
    needs = _resolved("algorithm.adv_estimator", lambda: estimator_needs(adv_estimator))
    if needs_critic(needs) and cfg.critic.model.path is not None:
        check_critic_model_path(cfg.critic.model.path)
    if not needs_critic(needs) and cfg.critic != CriticConfig():
        # verl's default estimator is gae, so a verl command line sets critic.* and means PPO.
        log.warning("critic.* is set, but algorithm.adv_estimator=%s trains no critic (verl's default estimator is "
                    "gae, hybridflow's grpo): set algorithm.adv_estimator=gae for PPO with a critic", alg.adv_estimator)
    check_reward_model(cfg)
    for need in sorted(needs):
        if ESTIMATOR_INPUT_SOURCES[need].generates and cfg.trainer.mode != "sync":
            raise ConfigError(
                f"algorithm.adv_estimator={alg.adv_estimator} needs {need}, a generation of its own during the "
                f"update, while trainer.mode={cfg.trainer.mode} generates the next step then; use trainer.mode=sync",
                key="trainer.mode",
            )
        if ESTIMATOR_INPUT_SOURCES[need].reads_tokens and cfg.trainer.data_plane == "refs":
            raise ConfigError(
                f"algorithm.adv_estimator={alg.adv_estimator} needs {need}, made in the controller from the samples' "
                f"tokens, which trainer.data_plane=refs keeps on the rollout replicas; use "
                f"trainer.data_plane=controller", key="trainer.data_plane",
            )
    adv_params = _resolved("algorithm", lambda: build_estimator_params(adv_estimator, vars(alg)))
    _resolved("actor.policy_loss.loss_mode", lambda: get_policy_loss(cfg.actor.policy_loss.loss_mode))
    # The rejection criteria and their thresholds, read as verl reads them (the actor parses them again).
    _resolved("algorithm.rollout_correction.rollout_rs", lambda: rollout_rs_criteria(alg.rollout_correction))
    # The loss's typed params: a policy_loss key that does not apply to the chosen loss fails here.
    _resolved("actor.policy_loss", lambda: build_actor_policy_loss(cfg.actor, alg.rollout_correction))
    if cfg.rollout.name not in ROLLOUT_ENGINES:
        raise ConfigError(f"rollout.name={cfg.rollout.name}: {engine_unavailable(cfg.rollout.name, 'cpu')}",
                          key="rollout.name")
    if check_machine:
        raise_all(machine_problems(cfg))
    check_rollout_model(cfg.model.path, cfg.rollout.name, cfg.rollout.tensor_model_parallel_size,
                        cfg.model.override_config, cfg.model.trust_remote_code)
    check_vision_language_run(cfg)
    try:
        check_chat_template_kwargs(cfg.data.apply_chat_template_kwargs)
    except ValueError as error:
        raise ConfigError(str(error), key="data.apply_chat_template_kwargs") from error
    try:
        named_sampler_class(cfg.data.sampler)  # imported now: a wrong path fails before any data loads
    except SamplerError as error:
        raise ConfigError(str(error), key=error.key) from error
    agent = agent_setup(cfg.rollout.multi_turn, cfg.data.apply_chat_template_kwargs)
    if agent is not None:
        check_agent_setup(agent, cfg.data)
    kl = alg.kl_ctrl
    kl_controller = _resolved("algorithm.kl_ctrl.type", lambda: get_kl_controller(
        kl.type, kl_coef=kl.kl_coef, target_kl=kl.target_kl, horizon=kl.horizon)) if alg.use_kl_in_reward else None
    return Plugins(adv_estimator, adv_params, needs, kl_controller, agent)


def check_reward_model(cfg: Config) -> None:
    """What ``reward_model.enable`` needs beyond the config's own checks: a sequence-classifier
    directory (config.json only, no weights) or, for the judge, its API key."""
    rm = cfg.reward_model
    if not rm.enable:
        return
    if rm.style == "discriminative":
        assert rm.model.path is not None, "validate_config requires it"
        try:
            check_sequence_classifier(rm.model.path, trust_remote_code=rm.model.trust_remote_code)
        except (OSError, ValueError) as error:
            raise ConfigError(f"reward_model.model.path: {error}", key="reward_model.model.path") from error
        return
    judge_api_key(cfg)  # httpx, the judge's HTTP client, is one of machine_problems


def judge_api_key(cfg: Config) -> str | None:
    """The judge's API key from ``reward_model.judge.api_key_env`` (None: no key), or a
    ``ConfigError`` naming the key when the variable is not set."""
    name = cfg.reward_model.judge.api_key_env
    if name is None:
        return None
    key = os.environ.get(name)
    if not key:
        raise ConfigError(f"reward_model.judge.api_key_env={name}: the environment variable {name} is not set "
                          "(export it, or set api_key_env=null for an endpoint without a key)",
                          key="reward_model.judge.api_key_env")
    return key


def build_reward_model_group(
    cfg: Config, model_path: str, device: torch.device, placement: Placement | None
) -> RewardModelGroup | None:
    """The reward model's role (``reward_model.enable``), or None. A discriminative model runs one
    rank per actor rank, colocated in the actor's bundles like the reference (on the local backend,
    in this process); the judge is one rank in this process, a client of its endpoint."""
    rm, common = cfg.reward_model, dict(policy_tokenizer_path=model_path,
                                        policy_trust_remote_code=cfg.model.trust_remote_code)
    if not rm.enable:
        return None
    if rm.style == "generative":
        j = rm.judge
        assert j.base_url is not None, "validate_config requires it"
        settings = JudgeSettings(
            base_url=j.base_url, model=j.model, prompt_template=j.prompt_template, api_key=judge_api_key(cfg),
            score_pattern=j.score_pattern, max_concurrency=j.max_concurrency, timeout_s=j.timeout_s,
            max_retries=j.max_retries, backoff_s=j.backoff_s, failure_score=j.failure_score,
            max_tokens=j.max_tokens, temperature=j.temperature,
        )
        judge_setup = JudgeSetup(settings=settings, **common)
        group = build_worker_group("local", "reward_model", lambda r, w: JudgeWorker(r, w, judge_setup), 1)
        return RewardModelGroup(group, JudgeWorker.score, JudgeWorker.close)
    assert rm.model.path is not None
    setup = RewardModelSetup(model_path=rm.model.path, dtype=cfg.model.dtype, device=device,
                             micro_batch_size=rm.micro_batch_size_per_gpu, max_length=rm.max_length,
                             trust_remote_code=rm.model.trust_remote_code, **common)
    group = build_worker_group(cfg.trainer.backend, "reward_model", lambda r, w: RewardModelWorker(r, w, setup),
                               data_parallel_size(cfg.trainer), placement)
    return RewardModelGroup(group, RewardModelWorker.score)


def reward_setup(cfg: Config, model_path: str, scorers: int = 1) -> RewardSetup:
    """What a reward worker is built from: the reward role's, and each rollout replica's on the
    by-reference data plane (``trainer.data_plane=refs``), where ``scorers`` (the replicas) share
    the run's limits on outside services."""
    custom, ob, d = cfg.reward.custom_reward_function, cfg.reward.overlong_buffer, cfg.data
    buffer_end = overlong_buffer_end(ob.max_response_length, d.max_response_length)
    return RewardSetup(
        tokenizer_path=model_path, custom_path=custom.path, custom_name=custom.name,
        timeout_s=cfg.reward.timeout_s,
        num_workers=scoring_processes(cfg.reward.reward_manager, cfg.reward.num_workers),
        batch=cfg.reward.reward_manager == "batch", reward_kwargs=dict(cfg.reward.reward_kwargs),
        startup_timeout_s=cfg.reward.startup_timeout_s, combine=cfg.reward_model.combine,
        overlong_buffer_len=(resolve_overlong_buffer(ob.len, buffer_end) if ob.enable else None),
        overlong_penalty_factor=ob.penalty_factor, max_response_length=buffer_end,
        trust_remote_code=cfg.model.trust_remote_code, sandbox_fusion=sandbox_fusion_settings(cfg, scorers),
    )


def sandbox_fusion_settings(cfg: Config, scorers: int = 1) -> SandboxFusionSettings | None:
    """The SandboxFusion service of reward.sandbox_fusion (None: no url), its requests bounded by reward.timeout_s.
    ``scorers`` reward workers (each rollout replica's, on the refs data plane, perhaps on other nodes: no lock
    reaches across them) share max_concurrent in equal parts, at least one request each."""
    sf = cfg.reward.sandbox_fusion
    if sf.url is None:
        return None
    return build_sandbox_fusion_settings(sf.url, max(1, sf.max_concurrent // scorers), sf.memory_limit_mb,
                                         sf.run_timeout_s, cfg.reward.timeout_s)


def build_reward_group(cfg: Config, model_path: str) -> WorkerGroup[RewardWorker]:
    """The reward role, in this process on every backend: scoring writes each trajectory's reward
    in place, and the manager already runs the scorers in supervised subprocesses. A custom reward
    function that cannot be loaded is a ``ConfigError`` on ``reward.custom_reward_function``."""
    custom = cfg.reward.custom_reward_function
    setup = reward_setup(cfg, model_path)
    try:
        return build_worker_group("local", "reward", lambda r, w: RewardWorker(r, w, setup), 1)
    except (ImportError, AttributeError, SyntaxError, TypeError, OSError, TimeoutError, RuntimeError) as error:
        if custom.path is None:
            raise
        key = "reward.custom_reward_function.name" if isinstance(error, AttributeError) else \
            "reward.custom_reward_function.path"
        raise ConfigError(f"{key}: {error}", key=key) from error


def build_critic_group(
    cfg: Config, model_path: str, device: torch.device, total_steps: int, placement: Placement | None
) -> WorkerGroup[CriticWorker]:
    """The critic role, one rank per actor rank, in the actor's placement bundles (colocated like
    the reference): trained like the actor, FSDP2 over its ranks. Its model starts from
    ``critic.model.path``, or the policy's own weights (``model_path``, the built-in model after
    its warm start)."""
    c, d = cfg.critic, cfg.data
    mini = c.ppo_mini_batch_size if c.ppo_mini_batch_size is not None else cfg.actor.ppo_mini_batch_size
    epochs = c.ppo_epochs if c.ppo_epochs is not None else cfg.actor.ppo_epochs
    setup = CriticSetup(
        model_path=c.model.path or model_path, dtype=cfg.model.dtype, device=device, rollout_n=cfg.rollout.n,
        ppo_mini_batch_size=mini, ppo_epochs=epochs,
        total_optimizer_steps=total_steps * (d.train_batch_size // mini) * epochs,
        max_response_length=d.max_response_length, max_prompt_length=d.max_prompt_length,
        gradient_checkpointing=cfg.model.enable_gradient_checkpointing, trust_remote_code=cfg.model.trust_remote_code,
        checkpoint_format=cfg.trainer.checkpoint_format,
    )
    return build_worker_group(cfg.trainer.backend, "critic", lambda r, w: CriticWorker(r, w, c, setup),
                              data_parallel_size(cfg.trainer), placement)


def apply_async_defaults(cfg: Config) -> None:
    """What the asynchronous loops change in the config they run (logged; the run's config.yaml
    shows the result): their samples come from older weights than the actor's, so by default
    the loss corrects for it (``async_training.behaviour_correction``)."""
    rc = cfg.algorithm.rollout_correction
    if cfg.trainer.mode != "sync" and cfg.async_training.behaviour_correction and rc.rollout_is is None \
            and not rc.bypass_mode:
        rc.rollout_is = "token"
        log.info("trainer.mode=%s: algorithm.rollout_correction.rollout_is=token (async_training.behaviour_correction)",
                 cfg.trainer.mode)


def _budget_groups(run: RunSetup) -> dict[str, tuple[WorkerGroup[Any], Any]]:
    """The training roles whose token budgets the run folder records, with each one's method."""
    groups: dict[str, tuple[WorkerGroup[Any], Any]] = {"actor": (run.actor, ActorWorker.token_budgets)}
    if run.critic is not None:
        groups["critic"] = (run.critic, CriticWorker.token_budgets)
    if run.reference is not None and run.reference is not run.actor:  # with LoRA the actor is its own reference
        groups["reference"] = (run.reference, ReferenceWorker.token_budgets)
    return groups


def build_run(cfg: Config) -> RunSetup:
    # 1. Config and names: everything that can be wrong in the config fails here.
    apply_async_defaults(cfg)
    warnings = validate_config(cfg)
    for w in warnings:
        log.warning("config: %s", w)
    weight_sync = resolve_weight_sync(cfg.rollout.weight_sync, cfg.trainer.backend)
    adapter_sync = cfg.actor.lora.rank > 0 and cfg.actor.lora.sync == "adapter"
    plugins = resolve_plugins(cfg)
    needs, kl_controller, agent = plugins.estimator_needs, plugins.kl_controller, plugins.agent
    t, d, a = cfg.trainer, cfg.data, cfg.actor
    device = config_device(t.device)
    storage = Storage(endpoint_url=cfg.storage.endpoint_url)
    check_storage(cfg, storage)
    local_model = fetch_model(cfg, storage)
    check_model_path(local_model)
    if local_model != cfg.model.path:  # resolve_plugins could not read a remote config.json
        check_rollout_model(local_model, cfg.rollout.name, cfg.rollout.tensor_model_parallel_size,
                            cfg.model.override_config, cfg.model.trust_remote_code)
    output_dir = resolve_output_dir(cfg)
    apply_recorded_budgets(cfg, output_dir)  # a resume cuts its batches as the run it continues did
    automatic_budgets = automatic_budget_keys(cfg)
    threads = configure_threads(t.num_threads)
    seed_everything(t.seed)
    (output_dir / "config.yaml").write_text(config_to_yaml(cfg))
    log.info("output: %s  device: %s  torch threads: %d", output_dir, device, threads)

    # 2-3. Files, data and the plan.
    model_path, train_files, val_files = resolve_builtin(cfg, device, local_model)
    chat_template = policy_chat_template(cfg.data)
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code, chat_template)
    # Without a custom reward function only the built-in scorers can score a row: check each
    # row's data_source now (a custom function decides per call what it scores). A reward model
    # that replaces the rule scores scores any row.
    replaced = cfg.reward_model.enable and cfg.reward_model.combine == "replace"
    scorable = None if cfg.reward.custom_reward_function.path or replaced else \
        known_data_sources(sandbox_fusion=cfg.reward.sandbox_fusion.url is not None)
    data_kwargs = dict(max_prompt_length=d.max_prompt_length, prompt_key=d.prompt_key, truncation=d.truncation,
                       filter_overlong_prompts=d.filter_overlong_prompts, on_bad_row=d.on_bad_row,
                       data_sources=scorable, storage=storage, image_key=d.image_key,
                       return_raw_chat=d.return_raw_chat, chat_template_kwargs=d.apply_chat_template_kwargs)
    vision = load_vision_processor(model_path, tokenizer, cfg.model.trust_remote_code) \
        if is_vision_language(model_path) else None
    data_kwargs["vision"] = vision
    train_data = RLDataset.from_files(train_files, tokenizer, **data_kwargs)
    log.info("train data: %s", train_data.describe())
    val_data = RLDataset.from_files(val_files, tokenizer, **data_kwargs) if val_files else None
    if val_data is None:
        log.warning("no data.val_files: validation is skipped")
    if agent is not None:
        check_row_agents([train_data, *([val_data] if val_data is not None else [])])
    agent_warning = agent_name_warning(train_data, cfg.rollout.multi_turn)
    if agent_warning is not None:
        log.warning("data: %s", agent_warning)
        warnings.append(agent_warning)
    # With dynamic sampling a step may draw several generation rounds of gen_batch_size prompts.
    gen_batch = d.gen_batch_size if cfg.algorithm.filter_groups.enable and d.gen_batch_size else d.train_batch_size
    if gen_batch > len(train_data):
        key = "data.gen_batch_size" if gen_batch != d.train_batch_size else "data.train_batch_size"
        raise ConfigError(f"{key}={gen_batch} prompts per step is more than the {len(train_data)} prompts loaded from "
                          f"data.train_files ({train_data.describe()}); use a smaller batch or more data", key=key)
    try:
        sampler = build_prompt_sampler(d, train_data, gen_batch, seed=d.seed if d.seed is not None else t.seed)
    except SamplerError as error:
        raise ConfigError(str(error), key=error.key) from error
    total_steps = planned_total_steps(sampler.steps_per_epoch, t.total_epochs, t.total_training_steps)
    assert total_steps is not None
    updates_per_batch = d.train_batch_size // a.ppo_mini_batch_size * a.ppo_epochs
    # One optimizer step per rollout batch is exactly on-policy: old == current logprobs, so the
    # extra forward is skipped (the actor detaches its own logprobs). In-reward KL needs them.
    # Rollout correction compares the trainer's old logprobs with the engine's.
    # Bypass mode uses the rollout's logprobs as the old ones and corrects inside the loss.
    # An estimator may need them too (optimal_token_baseline).
    rc = cfg.algorithm.rollout_correction
    # Importance weights alone need no extra forward when a batch makes one optimizer step: the
    # update's own detached logprobs are π_old (the actor weights its loss with them). Rejection
    # changes the loss's normaliser before the update, and batch-normalised weights divide by the
    # whole batch's mean, so those need them up front.
    corrects_old = not rc.bypass_mode and bool(
        rc.rollout_rs or (rc.rollout_is and (updates_per_batch > 1 or rc.rollout_is_batch_normalize)))
    needs_old = (updates_per_batch > 1 and not rc.bypass_mode) or cfg.algorithm.use_kl_in_reward or corrects_old \
        or needs_old_logprobs_for(needs)

    # Reward first: its workers load a custom reward function, the config's last pluggable name,
    # so a missing name, a syntax error or an import that hangs fails before any model loads.
    reward = build_reward_group(cfg, model_path)

    # 4. Workers.
    dp = data_parallel_size(t)
    if t.n_workers is not None and device.type == "cuda":
        raise ConfigError(f"trainer.n_workers={t.n_workers} counts CPU ranks, but this run computes on {device}: "
                          "GPU ranks are trainer.n_gpus_per_node x trainer.nnodes; set trainer.n_workers=null")
    with_reference = needs_reference_model(a.use_kl_loss, cfg.algorithm.use_kl_in_reward)
    reference_ranks = with_reference and a.lora.rank == 0  # LoRA: the actor serves the reference
    with_critic = needs_critic(needs)
    with_rm_ranks = cfg.reward_model.enable and cfg.reward_model.style == "discriminative"
    split = cfg.rollout.placement == "split"
    pools, placements = reserve_placements(
        t.backend, data_parallel_size=dp, device=device,
        colocated_roles=["actor", *([] if split else ["rollout"]), *(["reference"] if reference_ranks else []),
                         *(["critic"] if with_critic else []), *(["reward_model"] if with_rm_ranks else [])],
        split_roles=["rollout"] if split else [],
        ray_address=t.ray_address, ray_dashboard=t.ray_dashboard, num_threads=t.num_threads,
    )
    # The policy's model as every role builds it: the actor, its rollout engines and the reference.
    common = dict(trust_remote_code=cfg.model.trust_remote_code, override_config=cfg.model.override_config)
    actor_setup = ActorSetup(
        model_path=model_path, dtype=cfg.model.dtype, device=device, temperature=cfg.rollout.temperature,
        rollout_n=cfg.rollout.n, total_optimizer_steps=total_steps * updates_per_batch,
        max_response_length=d.max_response_length, max_prompt_length=d.max_prompt_length,
        gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
        rollout_correction=cfg.algorithm.rollout_correction, max_consecutive_skips=t.max_consecutive_skips,
        sum_pi_squared=needs_sum_pi_squared_for(needs), checkpoint_format=t.checkpoint_format, seed=t.seed,
        chat_template=policy_chat_template(d), **common,
    )
    actor = build_worker_group(t.backend, "actor", lambda r, w: ActorWorker(r, w, a, actor_setup), dp,
                               placements.get("actor"))
    rollout_dtype = resolve_run_rollout_dtype(cfg, device, model_path, output_dir)  # once for every replica
    rollout_setup = RolloutSetup(model_path=model_path, engine=cfg.rollout.name, dtype=rollout_dtype, device=device,
                                 max_batch_size=cfg.rollout.max_batch_size, seed=t.seed, agent=agent,
                                 enforce_eager=cfg.rollout.enforce_eager,
                                 enable_prefix_caching=cfg.rollout.enable_prefix_caching, mode=cfg.rollout.mode,
                                 max_num_batched_tokens=cfg.rollout.max_num_batched_tokens,
                                 enable_chunked_prefill=cfg.rollout.enable_chunked_prefill,
                                 max_logprob_mismatch=t.health.logprob_mismatch,
                                 lora_adapter_rank=cfg.actor.lora.rank if adapter_sync else 0,
                                 chat_template=policy_chat_template(d), **common,
                                 scoring=(reward_setup(cfg, model_path, rollout_replicas(cfg))
                                          if cfg.trainer.data_plane == "refs" else None))
    # One rollout replica per data-parallel rank, in that rank's bundle (next to its actor rank).
    # Samples are seeded per request, so the replica count does not change what is generated.
    rollout = build_rollout_replicas(cfg, rollout_setup, placements.get("rollout"))
    if weight_sync == BROADCAST:
        connect_weight_sync(actor, rollout)
    reference: WorkerGroup[ReferenceWorker] | WorkerGroup[ActorWorker] | None = None
    reference_logprobs: Callable[[Any, TrainBatch], torch.Tensor] = ReferenceWorker.compute_ref_logprobs
    if with_reference and a.lora.rank > 0:
        # LoRA: the reference policy is the actor's base model, its adapter switched off
        # (ActorWorker.compute_ref_logprobs): no second copy of the weights, no reference ranks.
        reference, reference_logprobs = actor, ActorWorker.compute_ref_logprobs
    elif with_reference:
        ref_sequence_parallel = sequence_parallel_sizes(cfg)["ref.ulysses_sequence_parallel_size"]
        ref_setup = ReferenceSetup(model_path=model_path, dtype=cfg.model.dtype, device=device,
                                   temperature=cfg.rollout.temperature,
                                   micro_batch_size=cfg.ref.log_prob_micro_batch_size_per_gpu,
                                   use_remove_padding=a.use_remove_padding, use_dynamic_bsz=a.use_dynamic_bsz,
                                   max_token_len=cfg.ref.log_prob_max_token_len_per_gpu,
                                   longest_sample=d.max_prompt_length + d.max_response_length,
                                   fsdp_size=a.fsdp_config.fsdp_size, offload_params=a.fsdp_config.param_offload,
                                   sequence_parallel_size=ref_sequence_parallel, use_torch_compile=a.use_torch_compile,
                                   **common)
        reference = build_worker_group(t.backend, "reference", lambda r, w: ReferenceWorker(r, w, ref_setup), dp,
                                       placements.get("reference"))
    critic = build_critic_group(cfg, model_path, device, total_steps, placements.get("critic")) if with_critic else None
    reward_model = build_reward_model_group(cfg, model_path, device, placements.get("reward_model"))
    # 5. Output.
    tracker = Tracker(t.logger, output_dir=output_dir, project=t.project_name, experiment=t.experiment_name,
                      config=config_to_dict(cfg))
    progress = ProgressBar.for_console(total_steps, enabled=t.progress_bar)
    timeline = Timeline(output_dir / TIMELINE_FILENAME, enabled=t.timeline)
    timeline.observe_worker_calls()  # until RunSetup.close
    rollout.timeline = timeline
    run = RunSetup(
        cfg=cfg, output_dir=output_dir, device=device, model_path=model_path,
        pad_token_id=int(tokenizer.pad_token_id), train_data=train_data, val_data=val_data, sampler=sampler,
        total_steps=total_steps, needs_old_logprobs=needs_old, adv_estimator=plugins.adv_estimator,
        adv_params=plugins.adv_params, estimator_needs=needs,
        kl_controller=kl_controller, actor=actor, rollout=rollout, reference=reference, reward=reward,
        reference_logprobs=reference_logprobs,
        actor_weights=ActorWorker.adapter_for_sync if adapter_sync else ActorWorker.weights_for_sync, critic=critic,
        tracker=tracker, progress=progress, tokenizer=tokenizer, vision=vision, warnings=warnings, pools=pools,
        weight_sync=weight_sync, validation_data_dir=dump_dir(t.validation_data_dir, output_dir),
        rollout_data_dir=dump_dir(t.rollout_data_dir, output_dir), reward_model=reward_model, timeline=timeline,
        storage=storage,
    )
    write_placement(output_dir, run.named_groups())  # where each rank of each role landed
    record_budgets(output_dir, automatic_budgets, _budget_groups(run))
    return run

