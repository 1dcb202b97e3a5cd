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

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridflow.algorithms import KLController
from hybridflow.cluster.backends import build_worker_group, elastic_placement, reserve_placements, runs_in_process
from hybridflow.cluster.ray_group import ResourcePool
from hybridflow.cluster.worker_group import WorkerGroup
from hybridflow.config import Config, ConfigError, config_to_dict, config_to_yaml, validate_config
from hybridflow.config.explain import (
    dpo_against_reference,
    needs_reference_model,
    planned_total_steps,
    prime_shares_reference,
)
from hybridflow.config.layout import (
    data_parallel_size,
    hybrid_engine_blockers,
    rollout_replicas,
    sequence_parallel_sizes,
    shares_processes,
)
from hybridflow.config.sections.trainer import FOLLOW_FREE_CORES
from hybridflow.controller.builtin import resolve_builtin
from hybridflow.controller.dumps import GenerationDumps
from hybridflow.controller.preflight import (
    agent_name_warning,
    check_model_path,
    check_rollout_model,
    check_row_agents,
    check_storage,
    config_device,
    fetch_model,
    needs_critic,
    needs_implicit_prm,
    needs_old_logprobs_for,
    needs_sum_pi_squared_for,
    policy_chat_template,
    resolve_plugins,
)
from hybridflow.controller.roles import (
    BROADCAST,
    Roles,
    build_critic_group,
    build_reward_group,
    build_reward_model_group,
    build_rollout_replicas,
    connect_weight_sync,
    resolve_weight_sync,
    reward_setup,
)
from hybridflow.controller.rollout_dtype import resolve_run_rollout_dtype
from hybridflow.controller.run_folder import check_shared_folders, lock_run_folder, write_placement
from hybridflow.controller.step_plan import Estimator, Prompts, StepPlan, build_step_plan
from hybridflow.controller.prime import (
    PRIME_REFERENCE_ROLE,
    PRIME_ROLE,
    ImplicitPRM,
    build_implicit_prm,
    check_prime_model,
    prime_model_path,
)
from hybridflow.controller.teachers import Teachers, build_teachers, check_teacher_sources, prepare_teacher_dirs
from hybridflow.controller.token_budgets import (
    apply_recorded_budgets,
    automatic_budget_keys,
    decide_threads,
    decide_train_dtype,
    record_budgets,
)
from hybridflow.data import RLDataset
from hybridflow.data.sampler_plugin import SamplerError, build_prompt_sampler
from hybridflow.models.loading import (
    load_tokenizer,
)
from hybridflow.models.vision import is_vision_language, load_vision_processor
from hybridflow.rewards.registry import known_data_sources
from hybridflow.tracking import ProgressBar, Tracker
from hybridflow.tracking.timeline import TIMELINE_FILENAME, Timeline
from hybridflow.types import TrainBatch
from hybridflow.utils.device import configure_threads
from hybridflow.utils.allocator import describe as describe_allocator
from hybridflow.utils.memory import configure_host_allocator
from hybridflow.utils.seed import seed_everything
from hybridflow.utils.storage import Storage, is_remote
from hybridflow.utils.threads import stop_following
from hybridflow.workers.actor import ActorSetup, ActorWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.dpo import DPOLossSpec
from hybridflow.workers.reference import ReferenceSetup, ReferenceWorker
from hybridflow.workers.rollout import RolloutSetup

log = logging.getLogger(__name__)


@dataclass
class RunSetup:
    """A built run: its roles, its frozen step plan, its prompts, and what it writes. The loops
    hand the phases the parts each one reads, never this whole record."""

    cfg: Config
    output_dir: Path
    device: torch.device
    model_path: str
    roles: Roles
    plan: StepPlan
    prompts: Prompts
    kl_controller: KLController | None  # algorithm.use_kl_in_reward: its state is checkpointed
    tracker: Tracker
    progress: ProgressBar
    dumps: GenerationDumps
    warnings: list[str] = field(default_factory=list)
    pools: list[ResourcePool] = field(default_factory=list)  # Ray resources reserved (trainer, split rollout)
    timeline: Timeline = field(default_factory=Timeline.disabled)  # trainer.timeline: <output_dir>/timeline.json
    storage: Storage = field(default_factory=Storage)  # how to reach s3:// and other URLs (storage.*)

    def close(self) -> None:
        stop_following()  # the thread governor lives as long as the run (configure_threads)
        self.timeline.close()  # the spans after the last step (validation, the final checkpoint)
        self.progress.close()
        self.tracker.close()
        self.roles.close()
        for pool in self.pools:
            pool.close()


def dump_dir(path: str | None, output_dir: Path) -> Path | None:
    """A generation dump folder (trainer.validation_data_dir, rollout_data_dir): a relative path is
    inside the run's folder, so a run's dumps travel with its metrics and checkpoints."""
    if not path:
        return None
    folder = Path(path).expanduser()
    return folder if folder.is_absolute() else output_dir / folder


def checkpoint_folders(cfg: Config, output_dir: Path) -> dict[str, Path]:
    """Where ranks write (checkpoint shards, exports), by config key: the run's folder, and
    ``trainer.checkpoint_dir`` when it is a local folder (a URL is written by this process)."""
    folders = {"trainer.output_dir": output_dir}
    if cfg.trainer.checkpoint_dir and not is_remote(cfg.trainer.checkpoint_dir):
        folders["trainer.checkpoint_dir"] = Path(cfg.trainer.checkpoint_dir).expanduser()
    return folders


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


def apply_async_defaults(cfg: Config) -> None:
    """What the asynchronous loops change in the config they run (logged; the run's config.yaml
    shows the result): their samples come from older weights than the actor's, so by default
    the loss corrects for it (``async_training.behaviour_correction``)."""
    rc = cfg.algorithm.rollout_correction
    # Online DPO's loss has no importance ratio: it learns from samples of any policy as they are.
    if cfg.trainer.mode != "sync" and cfg.async_training.behaviour_correction and rc.rollout_is is None \
            and not rc.bypass_mode and cfg.actor.loss != "dpo":
        rc.rollout_is = "token"
        log.info("trainer.mode=%s: algorithm.rollout_correction.rollout_is=token (async_training.behaviour_correction)",
                 cfg.trainer.mode)


def online_dpo_loss(cfg: Config) -> DPOLossSpec | None:
    """The actor's preference loss with ``actor.loss=dpo`` (``algorithm.online_dpo``), else None."""
    if cfg.actor.loss != "dpo":
        return None
    o = cfg.algorithm.online_dpo
    return DPOLossSpec(loss_type=o.loss_type, beta=o.beta, label_smoothing=o.label_smoothing,
                       reference_free=o.reference_free)


def _budget_groups(roles: Roles) -> dict[str, tuple[WorkerGroup[Any], Any]]:
    """The training roles whose token budgets the run folder records, with each one's method."""
    groups: dict[str, tuple[WorkerGroup[Any], Any]] = {"actor": (roles.actor, ActorWorker.token_budgets)}
    if roles.critic is not None:
        groups["critic"] = (roles.critic, CriticWorker.token_budgets)
    if roles.reference is not None and roles.reference is not roles.actor:  # with LoRA the actor is its own reference
        groups["reference"] = (roles.reference, ReferenceWorker.token_budgets)
    return groups


def build_run(cfg: Config) -> RunSetup:
    # 1. Config and names: everything that can be wrong in the config fails here.
    apply_async_defaults(cfg)
    warnings = validate_config(cfg)
    for w in warnings:
        log.warning("config: %s", w)
    shared_processes = shares_processes(cfg)  # trainer.hybrid_engine, where every colocated role can share
    weight_sync = resolve_weight_sync(cfg.rollout.weight_sync, cfg.trainer.backend, shared_processes)
    adapter_sync = cfg.actor.lora.rank > 0 and cfg.actor.lora.sync == "adapter"
    plugins = resolve_plugins(cfg)
    needs, kl_controller, agent = plugins.estimator_needs, plugins.kl_controller, plugins.agent
    t, d, a = cfg.trainer, cfg.data, cfg.actor
    device = config_device(t.device)
    configure_host_allocator(device)  # before the models load: this process computes on it (local backend)
    log.info(describe_allocator())
    storage = Storage(endpoint_url=cfg.storage.endpoint_url)
    check_storage(cfg, storage)
    local_model = fetch_model(cfg, storage)
    check_model_path(local_model)
    if local_model != cfg.model.path:  # resolve_plugins could not read a remote config.json
        check_rollout_model(local_model, cfg.rollout.name, cfg.rollout.tensor_model_parallel_size,
                            cfg.model.override_config, cfg.model.trust_remote_code)
    output_dir = resolve_output_dir(cfg)
    threads_by_rule = t.num_threads is None
    apply_recorded_budgets(cfg, output_dir)  # a resume cuts its batches (and sets threads) as the run it continues did
    automatic_budgets = automatic_budget_keys(cfg)
    decide_threads(cfg, output_dir)  # a first start: threads by a rule of the machine, recorded
    decide_train_dtype(cfg, device.type, output_dir)  # model.dtype=auto: a rule of the hardware, recorded
    follow = t.num_threads == FOLLOW_FREE_CORES
    threads = configure_threads(None if follow else t.num_threads, advise=threads_by_rule)
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
    teacher_dirs: dict[str, str] = {}
    if cfg.distillation.enable:
        # Before any worker starts: a teacher with another tokenizer, or a data_source without a teacher, is
        # refused now (the built-in teacher is made here, cached, as the warm start is).
        check_teacher_sources(cfg, [row.data_source for row in train_data[:]])
        teacher_dirs, notes = prepare_teacher_dirs(cfg, device, tokenizer)
        for note in notes:
            log.warning("distillation: %s", note)
        warnings.extend(notes)
    with_prime = needs_implicit_prm(needs)
    if with_prime:
        note = check_prime_model(cfg, tokenizer)  # a PRM with another tokenizer is refused before any worker starts
        if note is not None:
            log.warning("prime: %s", note)
            warnings.append(note)
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
    online_dpo = a.loss == "dpo"
    # Online DPO makes one optimizer step per pass over the step's pairs.
    updates_per_batch = a.ppo_epochs if online_dpo else d.train_batch_size // a.ppo_mini_batch_size * a.ppo_epochs
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
    # Distillation compares the actor's logprobs of the sampled tokens with the teachers' (the same forward);
    # online DPO's loss reads only the current and the reference policy's logprobs.
    needs_old = not online_dpo and ((updates_per_batch > 1 and not rc.bypass_mode) or cfg.algorithm.use_kl_in_reward
                                    or corrects_old or needs_old_logprobs_for(needs) or cfg.distillation.enable)

    # Reward first: its workers load a custom reward function, the config's last pluggable name,
    # so a missing name, a syntax error or an import that hangs fails before any model loads.
    reward = build_reward_group(cfg, model_path)

    # 4. Workers.
    dp = data_parallel_size(t)
    if t.n_workers is not None and device.type == "cuda":
        raise ConfigError(f"trainer.n_workers={t.n_workers} counts CPU ranks, but this run computes on {device}: "
                          "GPU ranks are trainer.n_gpus_per_node x trainer.nnodes; set trainer.n_workers=null")
    with_reference = needs_reference_model(a.use_kl_loss, cfg.algorithm.use_kl_in_reward, dpo_against_reference(cfg))
    reference_ranks = with_reference and a.lora.rank == 0  # LoRA: the actor serves the reference
    with_critic = needs_critic(needs)
    with_rm_ranks = cfg.reward_model.enable and cfg.reward_model.style == "discriminative"
    split = cfg.rollout.placement == "split"
    # rollout.elastic: the replicas reserve room one by one as they start (build_rollout_replicas).
    elastic = cfg.rollout.elastic and not runs_in_process(t.backend)
    pools, placements = reserve_placements(
        t.backend, data_parallel_size=dp, device=device, nnodes=t.nnodes,
        colocated_roles=["actor", *([] if split else ["rollout"]), *(["reference"] if reference_ranks else []),
                         *(["critic"] if with_critic else []), *(["reward_model"] if with_rm_ranks else []),
                         *teacher_dirs, *([PRIME_ROLE] if with_prime else []),
                         *([PRIME_REFERENCE_ROLE] if with_prime and not prime_shares_reference(cfg) else [])],
        split_roles=["rollout"] if split and not elastic else [],
        ray_address=t.joined_ray_address(), ray_dashboard=t.ray_dashboard, num_threads=None if follow else t.num_threads,
        share_processes=shared_processes,
    )
    if t.hybrid_engine and not runs_in_process(t.backend):
        blockers = hybrid_engine_blockers(cfg)
        log.info("trainer.hybrid_engine: %s", "one process per placement bundle" if shared_processes else
                 f"a process per rank ({'; '.join(blockers)})")
    # The policy's model as every role builds it: the actor, its rollout engines and the reference.
    common = dict(trust_remote_code=cfg.model.trust_remote_code, override_config=cfg.model.override_config)
    actor_setup = ActorSetup(
        model_path=model_path, dtype=cfg.model.dtype, device=device, temperature=cfg.rollout.temperature,
        rollout_n=cfg.rollout.n, total_optimizer_steps=total_steps * updates_per_batch,
        max_response_length=d.max_response_length, max_prompt_length=d.max_prompt_length,
        gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
        rollout_correction=cfg.algorithm.rollout_correction, max_consecutive_skips=t.max_consecutive_skips,
        sum_pi_squared=needs_sum_pi_squared_for(needs), checkpoint_format=t.checkpoint_format, seed=t.seed,
        chat_template=policy_chat_template(d), preference=online_dpo_loss(cfg), **common,
    )
    actor = build_worker_group(t.backend, "actor", lambda r, w: ActorWorker(r, w, a, actor_setup), dp,
                               placements.get("actor"))
    if not runs_in_process(t.backend):  # the actor's ranks (and the critic's, beside them) write checkpoints there
        check_shared_folders(checkpoint_folders(cfg, output_dir), "actor", actor)
    rollout_dtype = resolve_run_rollout_dtype(cfg, device, model_path, output_dir)  # once for every replica
    rollout_setup = RolloutSetup(model_path=model_path, engine=cfg.rollout.name, dtype=rollout_dtype, device=device,
                                 max_batch_size=cfg.rollout.max_batch_size, seed=t.seed, agent=agent,
                                 enforce_eager=cfg.rollout.enforce_eager,
                                 enable_prefix_caching=cfg.rollout.enable_prefix_caching, mode=cfg.rollout.mode,
                                 max_num_batched_tokens=cfg.rollout.max_num_batched_tokens,
                                 kv_cache_memory_bytes=cfg.rollout.kv_cache_memory_bytes,
                                 enable_chunked_prefill=cfg.rollout.enable_chunked_prefill,
                                 max_logprob_mismatch=t.health.logprob_mismatch,
                                 lora_adapter_rank=cfg.actor.lora.rank if adapter_sync else 0,
                                 chat_template=policy_chat_template(d), **common,
                                 scoring=(reward_setup(cfg, model_path, rollout_replicas(cfg))
                                          if cfg.trainer.data_plane == "refs" else None))
    # One rollout replica per data-parallel rank, in that rank's bundle (next to its actor rank).
    # Samples are seeded per request, so the replica count does not change what is generated.
    rollout = build_rollout_replicas(cfg, rollout_setup, placements.get("rollout"), elastic_placement(
        ranks_per_group=cfg.rollout.tensor_model_parallel_size, data_parallel_size=dp, device=device,
        num_threads=None if follow else t.num_threads) if elastic else None)
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
    teachers: Teachers | None = None
    if cfg.distillation.enable:
        teachers = build_teachers(cfg, teacher_dirs, device, placements,
                                  actor_log_prob_budget=actor.call_all(ActorWorker.token_budgets)[0][1])
    prime: ImplicitPRM | None = None
    if with_prime:
        prime = build_implicit_prm(cfg, prime_model_path(cfg, model_path), device, total_steps, placements,
                                   share_reference=prime_shares_reference(cfg),
                                   actor_budgets=actor.call_all(ActorWorker.token_budgets)[0])
    # 5. Output.
    tracker = Tracker(t.logger, output_dir=output_dir, project=t.project_name, experiment=t.experiment_name,
                      config=config_to_dict(cfg))
    progress = ProgressBar.for_console(total_steps, enabled=t.progress_bar)
    timeline = Timeline(output_dir / TIMELINE_FILENAME, enabled=t.timeline)
    timeline.observe_worker_calls()  # until RunSetup.close
    rollout.timeline = timeline
    roles = Roles(actor=actor, rollout=rollout, reward=reward, reference=reference, critic=critic,
                  reward_model=reward_model, teachers=teachers, prime=prime, reference_logprobs=reference_logprobs,
                  actor_weights=ActorWorker.adapter_for_sync if adapter_sync else ActorWorker.weights_for_sync,
                  weight_sync=weight_sync)
    plan = build_step_plan(cfg, total_steps=total_steps, pad_token_id=int(tokenizer.pad_token_id),
                           estimator=Estimator(plugins.adv_estimator, plugins.adv_params, needs),
                           needs_old_logprobs=needs_old, weight_sync=weight_sync)
    dumps = GenerationDumps(tokenizer, tracker, rollout_dir=dump_dir(t.rollout_data_dir, output_dir),
                            validation_dir=dump_dir(t.validation_data_dir, output_dir), max_samples=t.dump_max_samples,
                            max_chars=t.dump_max_chars, val_generations=t.log_val_generations)
    run = RunSetup(
        cfg=cfg, output_dir=output_dir, device=device, model_path=model_path, roles=roles, plan=plan,
        prompts=Prompts(train_data, sampler, val_data, vision), kl_controller=kl_controller, tracker=tracker,
        progress=progress, dumps=dumps, warnings=warnings, pools=pools, timeline=timeline, storage=storage,
    )
    write_placement(output_dir, roles.named_groups())  # where each rank of each role landed
    rollout.pool.on_change = lambda: write_placement(output_dir, roles.named_groups())  # ... and a replica that came or went
    record_budgets(output_dir, automatic_budgets, _budget_groups(roles), rollout.kv_cache_budget())
    return run

