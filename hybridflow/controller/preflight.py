"""What set-up checks and resolves before anything loads: every pluggable name (estimator, losses,
KL controller, agent loops, tools, sampler), the model and storage paths, what this machine
lacks (``machine_problems``), and which workers and forwards the estimator's inputs cost
(``ESTIMATOR_INPUT_SOURCES``). Each failure is a ``ConfigError`` naming its key, in well under
a second; ``hybridflow config explain`` runs the same checks."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridflow.agents import build_tool_parser, load_tools
from hybridflow.agents.base import agent_loop_class, agent_name_of
from hybridflow.agents.interactions import load_interaction_config
from hybridflow.agents.openai_agent import load_agent_function
from hybridflow.algorithms import (
    AdvantageEstimatorFn,
    KLController,
    build_estimator_params,
    estimator_needs,
    get_adv_estimator,
    get_kl_controller,
    get_policy_loss,
)
from hybridflow.config import Config, ConfigError
from hybridflow.config.engines import capabilities
from hybridflow.config.errors import MachineProblem, raise_all
from hybridflow.config.explain import BUILTIN_TINY
from hybridflow.config.schema import CriticConfig, DataConfig, MultiTurnConfig
from hybridflow.config.checks.run import TOOL_TASKS
from hybridflow.config.layout import data_parallel_size
from hybridflow.controller.builtin import builtin_visual_task
from hybridflow.data import PromptRow, RLDataset
from hybridflow.data.dataset import DataError, check_chat_template_kwargs
from hybridflow.data.sampler_plugin import SamplerError, named_sampler_class
from hybridflow.models.loading import (
    VL_MODEL_TYPES,
    check_model_dir,
    check_sequence_classifier,
    load_model_config,
)
from hybridflow.models.tokenizer_match import role_differences, tokenizer_differences
from hybridflow.models.vision import is_vision_language
from hybridflow.rollout.factory import (
    ROLLOUT_ENGINES,
    VL_ROLLOUT_ENGINE,
    engine_model_problem,
    engine_unavailable,
)
from hybridflow.tracking.loggers import missing_logger_packages
from hybridflow.utils.device import resolve_device
from hybridflow.utils.storage import Storage, StorageError, is_remote
from hybridflow.workers.policy_loss import build_actor_policy_loss, rollout_rs_criteria
from hybridflow.workers.rollout import AgentSetup

log = logging.getLogger(__name__)


# Loops that run a row in one generation, what a run without rollout.multi_turn does anyway.
SINGLE_TURN_AGENTS = frozenset({"single_turn", "single_turn_agent"})


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
    if model_config.get("model_type") in VL_MODEL_TYPES and not capabilities(engine).images:
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
        if not capabilities(cfg.rollout.name).images:
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
            name = agent_name_of(row.row_fields(), default="")
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

    adv_estimator: AdvantageEstimatorFn
    adv_params: object  # the estimator's params dataclass
    estimator_needs: frozenset[str]
    kl_controller: KLController | None  # algorithm.use_kl_in_reward
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
    implicit_prm: bool = False  # PRIME's implicit process reward model group (prime.*), trained each step


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
    # The implicit PRM trains on the step's samples, then scores them (or the reverse: prime.update).
    "implicit_rewards": EstimatorInputSource(implicit_prm=True, reads_tokens=True),
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


def needs_implicit_prm(estimator_needs: frozenset[str]) -> bool:
    """Whether the estimator's inputs come from PRIME's implicit PRM (its group is built, ``prime.*``)."""
    return any(ESTIMATOR_INPUT_SOURCES[need].implicit_prm for need in estimator_needs)


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
    elif t.device == "cuda" and t.n_workers is None and t.joined_ray_address() is None:
        wanted, have = data_parallel_size(t), torch.cuda.device_count()
        if have < wanted:
            lack(f"trainer.n_gpus_per_node={t.n_gpus_per_node} x trainer.nnodes={t.nnodes} asks for {wanted} GPUs, "
                 f"this machine has {have}; join a Ray cluster that has them (trainer.ray_address) or ask for "
                 f"fewer", "trainer.n_gpus_per_node")
    if t.backend == "ray" and t.nnodes > 1 and t.joined_ray_address() is None:
        # Each node's ranks go in a placement group on a node of its own: one node never holds two.
        lack(f"trainer.nnodes={t.nnodes} puts each node's ranks on a Ray node of its own, but trainer.ray_address=null "
             f"(and no RAY_ADDRESS) starts a one-node Ray cluster on this machine; join a cluster of {t.nnodes} nodes "
             f"(trainer.ray_address) or set trainer.nnodes=1", "trainer.nnodes")
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


def check_teacher_tokenizer(student: Any, teacher_dir: str, key: str, trust_remote_code: bool,
                            role: str = "teacher") -> str | None:
    """Refuse a distillation teacher (or another model that scores the policy's samples: ``role``, PRIME's
    implicit PRM) whose tokenizer is not the student's (``ConfigError`` on ``key``, every difference named): it
    scores the student's token ids, which it would read as other text. Returns a note when only the special
    tokens' roles differ (another eos, as between a base model and its chat model)."""
    from transformers import AutoTokenizer

    if not (Path(teacher_dir).expanduser() / "config.json").is_file():
        raise ConfigError(f"{key}={teacher_dir!r} is not a Hugging Face model directory (no config.json there); "
                          "point it at a local causal LM folder with the student's tokenizer", key=key)
    try:
        teacher = AutoTokenizer.from_pretrained(Path(teacher_dir).expanduser(), local_files_only=True,
                                                trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{key}={teacher_dir!r}: its tokenizer cannot be loaded ({error})", key=key) from error
    if teacher.pad_token_id is None:  # as load_tokenizer pads the student's
        teacher.pad_token = teacher.eos_token
    problems = tokenizer_differences(student, teacher)
    if problems:
        raise ConfigError(
            f"{key}={teacher_dir!r} does not share the student's tokenizer (model.path): {'; '.join(problems)}. "
            f"The {role} scores the student's token ids, so both must spell every token alike; use a {role} of "
            "the student's model family (the same tokenizer)", key=key)
    notes = role_differences(student, teacher)
    return f"{key}: the {role}'s special tokens play other roles ({'; '.join(notes)})" if notes else None
