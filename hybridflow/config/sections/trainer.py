"""The ``trainer``, ``async_training`` and ``storage`` sections: the loop, health, profiling."""

from __future__ import annotations

import os
from dataclasses import dataclass

from hybridflow.config.fields import f, sub

FOLLOW_FREE_CORES = "follow"
"""``trainer.num_threads=follow``: torch's threads follow the cores other processes leave free."""


@dataclass
class HealthConfig:
    zero_variance_group_fraction: float = f(
        1.0, "Warn when at least this fraction of prompt groups got one reward for all samples."
    )
    truncation_ratio: float = f(0.5, "Warn when at least this fraction of responses hits max_response_length.")
    min_entropy: float = f(0.01, "Warn when the policy's mean token entropy falls below this (nats).")
    logprob_mismatch: float = f(
        0.05, "Warn when rollout and trainer logprobs differ by at least this much (mean |diff| per token)."
    )
    reward_failure_rate: float = f(0.05, "Warn when at least this fraction of samples failed to score.")
    repeat_every: int = f(10, "Repeat a persisting warning every N steps.")


@dataclass
class AsyncTrainingConfig:
    staleness_threshold: int = f(
        1,
        "trainer.mode=fully_async: how many weight versions behind the actor a trained sample may be (by its "
        "oldest token). The rollout admits the prompts of generation round b (one batch of data.train_batch_size) "
        "once the actor has made b - 1 - staleness_threshold updates, so at most (staleness_threshold + 1) batches "
        "of prompt groups are in flight or queued; a group staler than this when the trainer takes it (possible "
        "with consume_order=completion) is dropped and counted (async/dropped_samples). 0: the synchronous "
        "algorithm.",
    )
    consume_order: str = f(
        "draw",
        "trainer.mode=fully_async: which finished prompt groups a step trains on. draw: the next "
        "data.train_batch_size groups in the order the sampler drew them (a step waits for its own long tail "
        "while the rollout generates later rounds; steps train on the prompts the sync loop would). completion: "
        "the first groups to finish, whatever round drew them (the trainer never waits on a long tail; which "
        "prompts a step gets depends on timing, and a group finishing late may be dropped as too stale).",
        choices=("draw", "completion"),
    )
    partial_rollout: bool = f(
        True,
        "trainer.mode=fully_async: push the new weights into the generation in flight after each update; samples "
        "in flight keep their tokens, recompute their keys and values under the new weights and go on, each token "
        "recording its version (Trajectory.token_versions). Native engine only; false (needed for vllm and sglang): "
        "weights change on the rollout only between batches.",
    )
    behaviour_correction: bool = f(
        True,
        "In the asynchronous modes (trainer.mode one_step_off | fully_async) samples come from older weights than "
        "the actor's: weight the policy loss by truncated importance ratios pi_old / pi_rollout per token (decoupled "
        "PPO, as AReaL and verl do: the actor's logprobs before the update are the proximal policy, the rollout's "
        "the behaviour policy). true sets algorithm.rollout_correction.rollout_is=token when it is null; false "
        "trains on stale samples uncorrected. No effect in sync mode.",
    )


@dataclass
class ProfileConfig:
    steps: list[int] = f(
        [],
        "Training steps to record with torch.profiler (e.g. [3, 4]): a Chrome trace per process under "
        "<run folder>/profile/step_<k>/ (the controller's, which holds every in-process role, and each Ray rank's); "
        "`hybridflow profile-summary <run>` prints the top operators and the per-phase split. verl's "
        "global_profiler.steps. Empty: no profiling (phases still carry profiler ranges, and NVTX ranges on a GPU).",
    )
    record_shapes: bool = f(False, "Record operator input shapes (larger traces).")
    with_stack: bool = f(False, "Record Python stacks per operator (much larger traces, slower steps).")
    profile_memory: bool = f(False, "Record tensor allocations and frees (the trace's memory events).")


RAY_ADDRESS_ENV = "RAY_ADDRESS"  # Ray's own variable for the cluster a driver joins


@dataclass
class TrainerConfig:
    mode: str = f(
        "sync",
        "The training loop: sync (generate step k with the weights after step k-1, then train on it; "
        "controller/sync.py) | one_step_off (generation of step k+1 overlaps the update of step k, so each step "
        "trains on samples one weight version behind the actor; controller/one_step_off.py) | fully_async (the "
        "rollout generates continuously in a thread of its own, at most async_training.staleness_threshold versions "
        "ahead, and the trainer takes finished prompt groups from a queue; controller/fully_async.py). Steps, "
        "prompts and seeds are the same in all three (fully_async with async_training.consume_order=draw).",
        choices=("sync", "one_step_off", "fully_async"),
    )
    data_plane: str = f(
        "controller",
        "Where the training samples' tokens travel. controller: each finished prompt group comes back to the "
        "controller, which scores it and collates the step's batch. refs: the rollout replica that generated a group "
        "scores it and keeps its tokens, rollout logprobs and images in its store (Ray's object store across "
        "processes); the controller holds records (rewards, lengths, loss-mask runs, versions, a handle) and decides "
        "on them (filtering, staleness, balancing, advantages), and each actor, reference and critic rank fetches "
        "its shard's tokens and collates it there. Same results, every loop; the controller holds no training "
        "token (validation still generates through it; trainer.rollout_data_dir fetches the dumped samples' tokens). "
        "Not with a reward model, or an estimator whose inputs are made from tokens in the controller (remax, "
        "optimal_token_baseline).",
        choices=("controller", "refs"),
    )
    total_epochs: int = f(1, "Passes over the training prompts.")
    total_training_steps: int | None = f(100, "Stop after this many steps (None: total_epochs).")
    test_freq: int = f(10, "Validate every N steps (<= 0: never; the last step always validates).")
    val_before_train: bool = f(True, "Validate before the first step.")
    save_freq: int = f(-1, "Checkpoint every N steps (<= 0: only at the end when save_final).")
    save_final: bool = f(True, "Checkpoint after the last step.")
    resume_mode: str = f("auto", "auto | disable | path.", choices=("auto", "disable", "path"))
    resume_from_path: str | None = f(None, "Checkpoint folder for resume_mode=path.")
    max_ckpt_to_keep: int | None = f(
        2,
        "Keep at most this many intact checkpoints (None: all). A damaged one is never deleted: it is "
        "reported and left in place.",
    )
    on_save_error: str = f(
        "stop",
        "A checkpoint save that fails (e.g. no space left on the disk) removes its partial folder and leaves "
        "the earlier checkpoints intact; then: stop (end the run with a one-line error) | warn (log it and "
        "keep training without that checkpoint).",
        choices=("stop", "warn"),
    )
    checkpoint_format: str = f(
        "auto",
        "How the actor and critic save: sharded (every rank writes its own shards of the model and optimizer with "
        "torch.distributed.checkpoint; nothing is gathered, so a save needs no memory for the whole model) | full "
        "(rank 0 gathers the whole model and optimizer and writes HF safetensors and optim.pt) | auto (sharded with "
        "more than one data-parallel rank, full with one). Either format resumes on any number of ranks, and "
        "hybridflow export writes a plain HF folder from both.",
        choices=("auto", "sharded", "full"),
    )
    seed: int = f(1, "Global seed (model init, sampling, data order).")
    output_dir: str | None = f(None, "Where the run writes everything. None: runs/<experiment>-<time>.")
    checkpoint_dir: str | None = f(
        None,
        "Where checkpoints are kept. None: <output_dir>/checkpoints. A local folder, or a folder in object storage "
        "(s3://bucket/run1/checkpoints, gs://...): each checkpoint is then written to <output_dir>/checkpoints as "
        "usual (atomic folder, SHA-256 manifest) and uploaded, manifest last; resume_mode=auto resumes from the "
        "newest complete one there (downloaded and verified first). verl's default_local_dir.",
    )
    project_name: str = f("hybridflow", "Project name for loggers.")
    experiment_name: str = f(
        "grpo-arithmetic",
        "Run name for loggers and the output folder. Left at this default, a run is named <preset>-<data> "
        "(e.g. dapo-arithmetic, grpo-gsm8k from the first train file's folder).",
    )
    logger: list[str] = f(["console", "jsonl"], "console | jsonl | tensorboard | wandb | mlflow (one name alone: a list "
                                                "of one). mlflow: MLFLOW_TRACKING_URI, else a local store in "
                                                "<output_dir>/mlruns (mlflow ui --backend-store-uri <that folder>).",
                          single_as_list=True)
    backend: str = f(
        "local",
        "Worker-group backend: local (every role in this process, one rank each) | ray (each rank a Ray actor "
        "process; the actor and reference ranks form a torch.distributed group and shard with FSDP2).",
        choices=("local", "ray"),
    )
    hybrid_engine: bool = f(
        True,
        "trainer.backend=ray: the colocated roles' ranks of each placement bundle (actor rank r, rollout replica r, "
        "the reference, critic, reward model and teacher ranks r) live in one process, as verl's hybrid engine, not "
        "a process each: one start-up and one copy of torch per bundle, and each actor rank hands the weights it "
        "gathers to the replica beside it in that process (rollout.weight_sync=auto; no broadcast group). A replica "
        "then dies only with its actor rank. Where a role cannot share (rollout.placement=split, rollout.elastic, "
        "rollout.tensor_model_parallel_size>1, trainer.mode other than sync, trainer.profile.steps, an engine other "
        "than native, rollout.max_replica_restarts above 0) the run keeps a process per rank and config explain "
        "says why. false: a process per rank of each role. verl's actor_rollout_ref.hybrid_engine sets it.",
    )
    n_gpus_per_node: int = f(1, "Data-parallel ranks per node (GPU runs; CPU runs too when n_workers is null).")
    nnodes: int = f(1, "Nodes (trainer.backend=ray). Above 1, each node's ranks (n_gpus_per_node, or on CPU "
                       "n_workers / nnodes) are a placement group Ray keeps on one node, no two on one node: ranks "
                       "0..k-1 on one, k..2k-1 on the next; needs a cluster of that many nodes to join "
                       "(trainer.ray_address or RAY_ADDRESS). 1: one placement group, as many ranks on a node as fit.")
    n_workers: int | None = f(
        None,
        "Data-parallel CPU ranks (trainer.backend=ray on CPU). null: n_gpus_per_node x nnodes. GPU runs count "
        "ranks as n_gpus_per_node x nnodes.",
    )
    ray_address: str | None = f(
        None,
        "Address of a running Ray cluster to join (e.g. 10.0.0.1:6379). null: the RAY_ADDRESS environment "
        "variable's cluster where it is set (as `ray job submit` and verl's launchers set it), else start a local "
        "one that listens on 127.0.0.1 only.",
    )
    max_restarts: int = f(
        0,
        "How many times a Ray run rebuilds itself after a worker process died (a dead actor, critic or reference "
        "rank, a lost node, a rollout replica past rollout.max_replica_restarts): the controller tears every worker "
        "group down, builds them again on the nodes with room and resumes from the newest intact checkpoint, as the "
        "same command would (steps after it are trained again). Counted in trainer/restarts, each logged with the "
        "fault. One more fault stops the run naming the dead rank and its node. A worker's own error (an exception, "
        "not a death) is never retried. Per command: a new command counts from 0.",
    )
    ray_dashboard: bool = f(False, "Start the Ray dashboard (on 127.0.0.1) with the local cluster; needs ray[default].")
    device: str = f(
        "auto",
        "auto | cpu | cuda. npu (verl's Ascend device) is read so that a verl NPU config can be checked; no machine "
        "runs it (hybridflow has no NPU backend): config explain lists it under 'cannot run here', train refuses it.",
        choices=("auto", "cpu", "cuda", "npu"),
    )
    device_memory_gb: float | None = f(
        None,
        "Memory of one device in GiB (2^30 bytes; the GPU's, or the RAM a CPU rank may use), for the memory plan "
        "of `hybridflow plan` and `hybridflow config explain`: each role's predicted peak per phase is checked "
        "against it, with the cheapest fix for a phase that does not fit. null: the plan shows the peaks without "
        "a fit check. Nothing else reads it: the token budgets and the KV cache still size themselves from the "
        "free memory at start-up.",
    )
    num_threads: int | str | None = f(
        None,
        "torch CPU threads of each process that computes. null: decided by a rule at the run's first start from "
        "the cores this process may use (in-process: every core but one, left to the rest of the machine; Ray: "
        "the cores split over the ranks; at most OMP_NUM_THREADS where set), recorded in <run "
        "folder>/token_budgets.json and read back by a resume, because the count changes float rounding. 'follow': every core, and fewer while other processes keep cores busy (looked "
        "at each phase, at most once a second; faster beside a busy process, not reproducible). A number fixes it.",
    )
    progress_bar: bool = f(
        True, "Show a progress bar on the console, where stderr is a terminal (a redirected log gets the console "
        "logger's per-step lines, not the bar's redraws).",
    )
    profile: ProfileConfig = sub(ProfileConfig, "torch.profiler traces of chosen steps.")
    timeline: bool = f(
        True,
        "Write <run folder>/timeline.json, a trace of each step's phases (trainer) and each rollout replica's "
        "serving time, for ui.perfetto.dev or chrome://tracing; `hybridflow timeline <run>` summarizes it. "
        "Rewritten after each step, holding the last 100 steps (at most 20,000 spans).",
    )
    balance_batch: bool = f(
        True,
        "Reorder each step's samples so every data-parallel rank gets a similar workload (Karmarkar-Karp "
        "over a linear + quadratic cost in sequence length); logs global_seqlen/*.",
    )
    max_consecutive_skips: int = f(
        10,
        "Abort after this many optimizer steps in a row were skipped for a non-finite loss or gradient "
        "norm (each skip is counted in actor/skipped_steps).",
    )
    watchdog_timeout_s: float | None = f(
        3600.0,
        "Exit (code 3, naming the phase, role, rank and method being waited on) when one phase of a step "
        "runs longer than this. None or <= 0: off.",
    )
    phase_timeouts: list[str] = f(
        [], "Per-phase limits overriding watchdog_timeout_s, e.g. [gen=7200,update_actor=1800]."
    )
    preempt_grace_s: float = f(
        25.0,
        "SIGTERM (a scheduler's preemption) or Ctrl-C: finish the step, save a checkpoint and exit 143 (130 for "
        "Ctrl-C) naming it, all within this many seconds; past it, or on a second signal, stop at once, abandoning "
        "the step (the newest checkpoint stands). Set it below the scheduler's grace before SIGKILL (Kubernetes' "
        "terminationGracePeriodSeconds and Slurm's KillWait are 30 s by default).",
    )
    validation_data_dir: str | None = f(
        None, "Write each validation's samples to <dir>/<step>.jsonl (input, output, gts, score, step, data_source and "
        "the reward's extras such as acc and pred). A relative path is inside the run's output folder. null: off.",
    )
    rollout_data_dir: str | None = f(
        None, "Write each training step's samples to <dir>/<step>.jsonl (prompt, response, gts, score, advantage, "
        "step, group_id, the reward's extras, response_tokens, the first 512 rollout logprobs, their token texts and "
        "version_runs: the policy version that generated them, as [version, tokens] runs). "
        "A relative path is inside the run's output folder. null: off.",
    )
    log_val_generations: int = f(
        0, "Validation samples (input, output, score) each validation sends to the loggers (verl's key): the "
        "console prints them, jsonl appends them to <output_dir>/val_generations.jsonl, tensorboard shows them as "
        "text (val/generations), wandb as a table, mlflow as a JSON artifact. Picked as verl picks them (sorted "
        "by input, shuffled with seed 42), so every validation shows the same prompts; texts cut to dump_max_chars. "
        "0: none.",
    )
    dump_max_samples: int = f(
        256, "Most samples per file of validation_data_dir and rollout_data_dir (the first ones: whole prompt groups "
        "first).",
    )
    dump_max_chars: int = f(
        4000, "Longest text per field of those files (prompt, response, ground truth, reward extras), cut with a "
        "'…[+N chars]' mark (token texts: whole tokens up to this many characters in all): a row stays under "
        "about 4 x this + 4 KB.",
    )
    critic_warmup: int = f(
        0,
        "With a critic (algorithm.adv_estimator=gae), the first N steps update only the critic (the actor and "
        "its rollout stay as they are), so that PPO's advantages start from a fitted value model; ignored "
        "without one. verl counts one step fewer (its step N already updates the actor).",
    )
    health: HealthConfig = sub(HealthConfig, "Thresholds of the health warnings (health/* metrics).")

    def joined_ray_address(self) -> str | None:
        """The Ray cluster a Ray run joins: ``ray_address``, else ``RAY_ADDRESS`` (read when asked, not
        at load, so a saved config does not carry one machine's environment); None: a local cluster."""
        return self.ray_address or os.environ.get(RAY_ADDRESS_ENV) or None


@dataclass
class StorageConfig:
    endpoint_url: str | None = f(
        None,
        "S3-compatible server for s3:// URLs (MinIO, Cloudflare R2, a local test server), e.g. "
        "http://127.0.0.1:9000. None: AWS itself, or botocore's AWS_ENDPOINT_URL. Credentials always come from the "
        "backend's usual chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws, an instance role; "
        "GOOGLE_APPLICATION_CREDENTIALS for gs://), never from the config file.",
    )
    cache_dir: str = f(
        "~/.cache/hybridflow/models",
        "Where a model.path in object storage is downloaded (one folder per URL), reused while the remote files are "
        "unchanged and the copy's SHA-256 manifest verifies.",
    )
