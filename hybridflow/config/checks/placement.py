"""Where the roles run and how weights and sequences are split: the backend, rollout replicas and
tensor parallelism, the rollout engine's limits, FSDP precision and offload, Ulysses groups, LoRA's
weight sync, the prefill budget."""

from __future__ import annotations

from hybridflow.config.budget import read_model_shape
from hybridflow.config.checks.report import Report, divisors_near, or_list
from hybridflow.config.engines import capabilities, engines_with
from hybridflow.config.layout import (
    data_parallel_size,
    dp_source,
    rollout_replicas,
    sequence_parallel_sizes,
)
from hybridflow.config.schema import Config


def _check_refs_data_plane(cfg: Config, report: Report) -> None:
    """trainer.data_plane=refs keeps the tokens off the controller: what reads them there is refused."""
    refuse = []
    if cfg.reward_model.enable:
        refuse.append("reward_model.enable=true (the reward model scores tokens the controller sends it)")
    for reason in refuse:
        report.error(f"trainer.data_plane=refs is not built with {reason}; use trainer.data_plane=controller")


def check_prefill_budget(cfg: Config, report: Report) -> None:
    """With chunked prefill off a prompt is prefilled whole in one step. A budget below the longest
    sequence is what verl's SGLang examples set (verl gives SGLang neither key): every engine still
    prefills such a prompt whole, in a step of its own (SGLang bounds a prefill batch by the larger of
    the budget and the context; the native engine does the same; vLLM, which refuses to start below
    its context with chunking off, gets the budget raised to it), so this is a note, not an error."""
    r, d = cfg.rollout, cfg.data
    longest = d.max_prompt_length + d.max_response_length
    if not r.enable_chunked_prefill and r.max_num_batched_tokens < longest:
        report.warn(f"rollout.enable_chunked_prefill=false with rollout.max_num_batched_tokens="
                    f"{r.max_num_batched_tokens} below a whole sequence (data.max_prompt_length + "
                    f"data.max_response_length = {longest} tokens): a longer prompt is prefilled whole in a step of "
                    f"its own (vLLM gets the budget raised to the model's context)")


def _check_vllm(cfg: Config, report: Report) -> None:
    """What rollout.name=vllm cannot do (hybridflow/rollout/vllm_engine.py says why)."""
    replicas = rollout_replicas(cfg)
    if replicas > 1 and cfg.trainer.backend == "local":
        # vLLM keeps its distributed state per process: a second engine in one process fails to start.
        report.error(f"rollout.name=vllm runs one vLLM engine per process, but trainer.backend=local would start "
                     f"{replicas} rollout replicas ({dp_source(cfg.trainer)}) in this one; use trainer.backend=ray, "
                     f"or one data-parallel rank")
    r = cfg.rollout
    if r.top_p < 1.0 or r.top_k not in (-1, 0):
        report.error(f"rollout.name=vllm reports logprobs after top-p/top-k filtering (renormalised over the kept "
                     f"tokens), not the full-vocabulary logprobs the trainer computes; with rollout.top_p={r.top_p} "
                     f"and rollout.top_k={r.top_k} the importance ratios would be biased: use rollout.top_p=1 and "
                     f"rollout.top_k=-1, or rollout.name=native")


def check_lora(cfg: Config, report: Report) -> None:
    """``actor.lora``: checked whatever the rank, so a wrong value fails before LoRA is switched on."""
    lora = cfg.actor.lora
    if lora.rank < 0:
        report.error(f"actor.lora.rank={lora.rank} must be >= 0 (0: LoRA off; e.g. 8 or 16)")
    if not lora.alpha > 0:
        report.error(f"actor.lora.alpha={lora.alpha} must be > 0 (the update is scaled by alpha / rank; e.g. 16)")
    if not 0 <= lora.dropout < 1:
        report.error(f"actor.lora.dropout={lora.dropout} must be in [0, 1) (e.g. 0.05)")
    if lora.base_dtype != "float32" and lora.rank == 0:
        report.error(f"actor.lora.base_dtype={lora.base_dtype} stores LoRA's frozen base, but actor.lora.rank=0 "
                     f"trains every weight (kept in float32 master weights); set actor.lora.rank > 0, or "
                     f"model.dtype=bfloat16 for bf16 compute without LoRA")
    if lora.sync == "adapter":
        if not capabilities(cfg.rollout.name).adapter_merging:
            report.error(f"actor.lora.sync=adapter: the rollout merges the adapter itself, which only the native "
                         f"engine's worker does; rollout.name={cfg.rollout.name} takes actor.lora.sync=merged")
        if cfg.trainer.mode == "fully_async":
            report.error("actor.lora.sync=adapter: trainer.mode=fully_async stages whole weight snapshots; use "
                         "actor.lora.sync=merged")
    modules = lora.target_modules
    if not modules or not all(isinstance(m, str) and m for m in modules):
        report.error(f"actor.lora.target_modules={modules} must name at least one module, e.g. [all-linear] or "
                     f"[q_proj, v_proj]")
    elif "all-linear" in modules and len(modules) > 1:
        report.error(f"actor.lora.target_modules={modules}: all-linear already means every linear layer; give it "
                     f"alone, or list module names without it")


def _check_elastic(cfg: Config, report: Report) -> None:
    """``rollout.elastic`` and its bounds: replicas that come and go with the nodes of a Ray cluster."""
    r, t = cfg.rollout, cfg.trainer
    if not r.elastic:
        if r.max_replicas is not None or r.min_replicas != 1:
            report.error(f"rollout.min_replicas={r.min_replicas} / rollout.max_replicas={r.max_replicas} bound an "
                         f"elastic rollout; set rollout.elastic=true, or leave them out (a fixed rollout has one "
                         f"replica per rollout.tensor_model_parallel_size data-parallel ranks)")
        return
    if t.backend == "local":
        report.error("rollout.elastic=true adds and removes replicas as nodes of a Ray cluster join and leave, but "
                     "trainer.backend=local runs one replica in this process; use trainer.backend=ray")
    if r.placement != "split":
        # A colocated replica shares its actor rank's bundle (its GPU, taking turns with training):
        # a replica on a node that joined has no actor rank beside it, and one that left takes its rank with it.
        report.error("rollout.elastic=true starts replicas on nodes that join, each in a reservation of its own, but "
                     "rollout.placement=colocated puts replica k in actor rank k's placement bundle, beside that "
                     "rank (a node that joins has no actor rank); use rollout.placement=split")
    if r.max_replicas is None:
        report.error("rollout.elastic=true needs rollout.max_replicas: the most replicas the run may start "
                     "(e.g. the nodes it may get)")
    elif r.max_replicas < r.min_replicas:
        report.error(f"rollout.max_replicas={r.max_replicas} must be >= rollout.min_replicas={r.min_replicas}")


def check_backend(cfg: Config, report: Report) -> None:
    """trainer.backend and the keys that only mean something for one backend."""
    t = cfg.trainer
    dp = data_parallel_size(t)
    if t.backend == "local" and dp > 1:
        report.error(
            f"trainer.backend=local runs every role in this process with one rank, but {dp_source(t)} asks for "
            f"{dp} data-parallel ranks; use trainer.backend=ray (each rank its own process), or one rank"
        )
    if t.n_workers is not None and t.device == "cuda":
        report.error(
            f"trainer.n_workers={t.n_workers} counts CPU ranks, but trainer.device=cuda: GPU ranks are "
            f"trainer.n_gpus_per_node x trainer.nnodes; set n_workers to null"
        )
    # Only CPU ranks (trainer.n_workers) can fail this: GPU ones are n_gpus_per_node x nnodes.
    if t.backend == "ray" and t.nnodes > 1 and dp % t.nnodes:
        report.error(f"{dp_source(t)} ranks do not split evenly over trainer.nnodes={t.nnodes} nodes: each node holds "
                     f"the same number of ranks (a placement group of its own); use a multiple of {t.nnodes}")
    if cfg.rollout.placement == "split" and t.backend == "local":
        report.error("rollout.placement=split gives the rollout a resource pool of its own, but trainer.backend=local "
                     "runs every role in this process; use trainer.backend=ray, or rollout.placement=colocated")
    _check_elastic(cfg, report)
    tp = cfg.rollout.tensor_model_parallel_size
    if tp > 1 and t.backend == "local":
        report.error(
            f"rollout.tensor_model_parallel_size={tp} spreads one engine over {tp} processes, but trainer.backend=local "
            f"runs in this one; use trainer.backend=ray with {dp_source(t)} a multiple of {tp}, or 1"
        )
    elif tp > 1 and dp % tp:
        report.error(
            f"rollout.tensor_model_parallel_size={tp} must divide the {dp} data-parallel ranks ({dp_source(t)}): "
            f"each rollout replica spans {tp} of them"
        )
    per_node = dp // max(1, t.nnodes)
    if tp > 1 and t.backend == "ray" and t.nnodes > 1 and not dp % t.nnodes and per_node % tp \
            and not cfg.rollout.elastic:
        report.warn(f"rollout.tensor_model_parallel_size={tp} does not divide the {per_node} ranks of each node "
                    f"({dp_source(t)} over trainer.nnodes={t.nnodes}): some replicas span two nodes, their every step "
                    f"crossing the network")
    if tp > 1 and cfg.rollout.sleep_level == 2 and cfg.rollout.free_cache_engine:
        report.error(f"rollout.sleep_level=2 (drop the weights between steps) is not built for tensor-parallel replicas "
                     f"(rollout.tensor_model_parallel_size={tp}); use rollout.sleep_level=1")
    engine = capabilities(cfg.rollout.name)
    if cfg.rollout.mode == "server" and (not engine.http_serving or tp > 1):
        report.error(f"rollout.mode=server serves the native engine of one-rank replicas over HTTP, not rollout.name="
                     f"{cfg.rollout.name} with rollout.tensor_model_parallel_size={tp}; use rollout.mode=engine")
    if tp > 1 and not engine.tensor_parallel:
        # vLLM and SGLang split a replica's model over its tp devices themselves (tensor_parallel_size, --tp-size).
        report.error(f"rollout.tensor_model_parallel_size={tp} is built for "
                     f"rollout.name={engines_with('tensor_parallel')}, not {cfg.rollout.name!r}")
    if cfg.rollout.name == "vllm":
        _check_vllm(cfg, report)
    if t.mode == "fully_async" and cfg.async_training.partial_rollout and not engine.partial_rollout:
        report.error(f"async_training.partial_rollout=true (new weights pushed into the generation in flight) is built "
                     f"for rollout.name={engines_with('partial_rollout')}, not {cfg.rollout.name}; set "
                     f"async_training.partial_rollout=false")
    if t.data_plane == "refs":
        _check_refs_data_plane(cfg, report)
    if t.backend == "local" and cfg.rollout.weight_sync == "broadcast":
        report.error(
            "rollout.weight_sync=broadcast streams weights from actor rank 0 to the rollout process, but "
            "trainer.backend=local runs both in this process, where weights are copied directly; use "
            "rollout.weight_sync=auto, or trainer.backend=ray"
        )
    if t.backend == "local":
        # In-process workers die with the controller: there is nothing left to rebuild them.
        for key, value in (("ray_address", t.ray_address), ("ray_dashboard", t.ray_dashboard),
                           ("max_restarts", t.max_restarts)):
            if value:
                report.warn(f"trainer.{key}={value} has no effect with trainer.backend=local (set trainer.backend=ray)")
    elif t.joined_ray_address() is not None and t.ray_dashboard:
        report.warn("trainer.ray_dashboard=true has no effect with trainer.ray_address: the joined cluster keeps its "
                    "own dashboard settings")
    fsdp = cfg.actor.fsdp_config
    # verl's create_device_mesh shards over every rank when fsdp_size >= the ranks (its 64-GPU
    # example's fsdp_size=32 on fewer GPUs): the same here.
    if fsdp.fsdp_size != -1 and fsdp.fsdp_size < dp and (fsdp.fsdp_size < 1 or dp % fsdp.fsdp_size):
        report.error(f"actor.fsdp_config.fsdp_size={fsdp.fsdp_size} must divide the {dp} data-parallel ranks "
                     f"({dp_source(t)}), or be -1 or at least {dp} (shard over all of them)")
    _check_fsdp_precision_and_offload(cfg, dp, report)
    if cfg.actor.freeze_vision_tower and cfg.actor.lora.rank > 0:
        # LoRA already freezes every base weight; frozen adapters inside the tower would leave checkpoints
        # and exports disagreeing on which adapters exist.
        report.error("actor.freeze_vision_tower=true with actor.lora.rank > 0: LoRA trains only adapters; keep "
                     "the vision tower out of them with actor.lora.exclude_modules (e.g. '.*visual.*') instead")
    _check_sequence_parallel(cfg, dp, report)


def _check_fsdp_precision_and_offload(cfg: Config, dp: int, report: Report) -> None:
    """The actor's and critic's ``fsdp_config`` offload and dtypes. param_offload on one GPU rank is
    honoured by sharding over a one-rank group (the workers do it), so only a CPU run refuses it."""
    for role in ("actor", "critic"):
        fsdp = getattr(cfg, role).fsdp_config
        key = f"{role}.fsdp_config"
        if fsdp.param_offload and cfg.trainer.device == "cpu":
            report.error(f"{key}.param_offload=true moves parameters from the GPU to the CPU, but "
                         f"trainer.device={cfg.trainer.device}: on a CPU run they are in host memory already")
        if fsdp.model_dtype == "bfloat16" and cfg.model.dtype != "bfloat16":
            report.error(f"{key}.model_dtype=bfloat16 stores the trained weights in bf16, so they compute in bf16: "
                         f"set model.dtype=bfloat16 too (model.dtype={cfg.model.dtype} over float32 weights is "
                         f"{key}.model_dtype=float32)")
        if fsdp.reduce_dtype != "float32" and dp == 1 and not fsdp.param_offload:
            report.warn(f"{key}.reduce_dtype={fsdp.reduce_dtype} has no effect: one unsharded rank reduces no "
                        "gradients")
    if cfg.actor.fsdp_config.model_dtype == "bfloat16" and cfg.actor.lora.rank > 0:
        report.error("actor.fsdp_config.model_dtype=bfloat16 with actor.lora.rank > 0: LoRA's adapters stay float32 "
                     "(they are small) and its frozen base is stored as actor.lora.base_dtype says; set "
                     "actor.lora.base_dtype=bfloat16 instead")


def _check_sequence_parallel(cfg: Config, dp: int, report: Report) -> None:
    """Ulysses groups: blocks of sp ranks, over packed micro-batches, splitting the model's heads
    (read from its config.json where it is readable now; the engine checks again when it loads)."""
    packed = {"actor": cfg.actor.use_remove_padding, "ref": cfg.actor.use_remove_padding,
              "critic": cfg.critic.use_remove_padding}
    paths = {"actor": cfg.model.path, "ref": cfg.model.path, "critic": cfg.critic.model.path or cfg.model.path}
    for key, sp in sequence_parallel_sizes(cfg).items():
        role = key.split(".")[0]
        shape = read_model_shape(paths[role]) if sp > 1 else None
        heads, kv_heads = (shape.num_attention_heads, shape.num_key_value_heads) if shape else (sp, sp)
        if sp < 1:
            report.error(f"{key}={sp} must be >= 1 (1: no sequence parallelism)")
        elif dp % sp:
            report.error(f"{key}={sp} must divide the {dp} ranks ({dp_source(cfg.trainer)}): each block of {sp} "
                         f"ranks splits the same micro-batches; use a divisor of {dp}, e.g. "
                         f"{or_list(divisors_near(dp, sp))}")
        elif sp > 1 and not packed[role]:
            remove_padding = "critic.use_remove_padding" if role == "critic" else "actor.use_remove_padding"
            report.error(f"{key}={sp} splits packed sequences; it needs {remove_padding}=true")
        elif heads % sp or (kv_heads % sp and sp % kv_heads):
            report.error(f"{key}={sp} must divide the {heads} attention heads of {paths[role]} (and divide or be a "
                         f"multiple of its {kv_heads} key-value heads): each rank attends with heads/{sp} of them")
