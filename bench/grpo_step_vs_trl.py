"""One GRPO step, end to end: hybridflow (defaults, and each speed knob) vs TRL's ``GRPOTrainer``.

The same work on both sides: a ~18M-parameter Qwen2-shaped model (vocab 4096, hidden 512,
6 layers, GQA 8/2) written once as a local Hugging Face directory with a locally built
tokenizer; ``--prompts`` chat prompts x ``--n`` samples per step at temperature 1, responses of
long-tailed lengths (lognormal, median ``--median-tokens``, sigma ``--sigma``, capped at
``--max-tokens``), torch threads fixed to ``--threads``, AdamW at the same lr
(constant schedule, no weight decay, gradient clip 1.0), one optimizer step per generated
batch (so neither side computes old logprobs), the same reward function, and with
``--kl on`` a frozen reference with the k3 KL loss at coefficient 0.04 (TRL's ``beta``).

Response lengths come from a length oracle, the same for both sides: a logits processor that
forbids EOS before the sample's target length and forces it there (``target_lengths``; prompt i's
sample j always gets the same length). A random-weight model would otherwise never stop, and a
model trained to stop would stop at different lengths on each side; this way both generate and
train on exactly the same number of tokens. The oracle is injected at each side's generation
boundary (TRL: ``model.generate``'s ``logits_processor``; hybridflow: the native engine's
``logits_processors``); nothing else of either framework is changed.

Each configuration runs in its own subprocess (a clean peak RSS): ``--warmup`` steps, then
``--steps`` timed ones (median). Configurations alternate within each of ``--repeats`` rounds,
and the table shows the median over rounds. Columns:

- s/step: wall time of one RL step (generation, reward, logprobs, update, weight sync);
- generation: generating the responses (TRL: its ``generate`` call; hybridflow: ``timing_s/gen``);
- update: the rest of the step (s/step - generation), the same definition for both sides;
- tokens/s: prompt + response tokens of the step / s/step;
- peak RSS: the worker process's peak resident memory plus the peak of its child processes
  (hybridflow's reward scorer runs in one).

TRL runs twice: on the micro-batches of hybridflow's padded fixed path (64 samples, no gradient
checkpointing, as hybridflow's ``model.enable_gradient_checkpointing=false``): the baseline of the
ratios; with its own defaults (8 samples, gradient checkpointing on), for reference; and
``trl_bf16``, the first with TRL's ``bf16=True``. TRL computes in fp32 unless told; hybridflow in its
default ``model.dtype=auto`` (bf16-mixed on a CPU with avx512_bf16/AMX, fp32 elsewhere; the header says
which), so on a bf16 CPU ``trl_bf16`` is the like-for-like baseline and ``trl`` what TRL does by default.

    python bench/grpo_step_vs_trl.py                 # the full table, KL off and on (long: ~1 h on 2 cores)
    python bench/grpo_step_vs_trl.py --quick         # smoke run (~1 min)
    python bench/grpo_step_vs_trl.py --kl off --configs trl defaults --repeats 1
    python bench/grpo_step_vs_trl.py --kl off --configs trl defaults --repeats 1 --isa avx2   # AVX2-only kernels
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Each configuration: hybridflow overrides, or (TRL) GRPOConfig fields.
CONFIGS: dict[str, list[str] | dict] = {
    # TRL on the micro-batches of hybridflow's padded fixed path (64 samples), no recompute (as hybridflow).
    "trl": {"per_device_train_batch_size": 64, "gradient_checkpointing": False},
    # TRL's own defaults: 8 samples per micro-batch, gradient checkpointing on.
    "trl_defaults": {"per_device_train_batch_size": 8, "gradient_checkpointing": True},
    # TRL in bf16-mixed (its ``bf16=True``: fp32 weights, autocast), what hybridflow's model.dtype=auto
    # picks on a CPU with avx512_bf16/AMX: the like-for-like baseline there.
    "trl_bf16": {"per_device_train_batch_size": 64, "gradient_checkpointing": False, "bf16": True},
    "defaults": [],
    "padded": ["actor.use_remove_padding=false"],
    "packed_fixed": ["actor.use_dynamic_bsz=false"],
    "padded_fixed": ["actor.use_remove_padding=false", "actor.use_dynamic_bsz=false"],
    # The rollout's KV cache kept through the update (no sleep between generation and training).
    "keep_cache": ["rollout.free_cache_engine=false"],
    # The rollout's weights freed too between generation and the weight sync.
    "sleep2": ["rollout.sleep_level=2"],
}
LABELS = {
    "trl": "TRL GRPOTrainer (micro-batch 64, no checkpointing)",
    "trl_defaults": "TRL GRPOTrainer (its defaults: 8, checkpointing)",
    "trl_bf16": "TRL GRPOTrainer (micro-batch 64, bf16=True)",
    "defaults": "hybridflow, defaults",
    "padded": "hybridflow, use_remove_padding=false",
    "packed_fixed": "hybridflow, use_dynamic_bsz=false",
    "padded_fixed": "hybridflow, both false (the old defaults)",
    "keep_cache": "hybridflow, rollout.free_cache_engine=false",
    "sleep2": "hybridflow, rollout.sleep_level=2",
}
EOS_TOKEN_ID = 258  # <|im_end|>
PAD_TOKEN_ID = 256  # <|endoftext|>
VOCAB_SIZE = 4096
KL_COEF = 0.04  # TRL's usual beta; hybridflow's actor.kl_loss_coef
LR = 1e-6
PROMPT_MARK = re.compile(r"Q(\d+):")

REWARD_SOURCE = '''
def score(text):
    """A cheap reward with variance inside each group: the response's length in characters mod 3."""
    return float(len(text) % 3 == 0)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return score(solution_str)
'''


# --------------------------------------------------------------------------------------------
# The shared workload: model directory, prompts, target lengths
# --------------------------------------------------------------------------------------------


def build_tokenizer():
    """The built-in byte-level tokenizer (bytes 0-255, specials 256-258) widened to VOCAB_SIZE
    with two-character tokens, so every id the model can sample decodes (encoding never
    produces them: there are no merges, prompts stay byte-level)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hybridflow.models.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, byte_to_unicode

    chars = list(byte_to_unicode().values())
    vocab = {ch: i for i, ch in enumerate(chars)}
    vocab.update({token: 256 + i for i, token in enumerate(SPECIAL_TOKENS)})
    printable = [c for c in chars if c.isalnum()]
    pairs = (a + b for a in printable for b in printable)
    while len(vocab) < VOCAB_SIZE:
        vocab.setdefault(next(pairs), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_model(out: Path, quick: bool) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from hybridflow.models.loading import hf_progress_bars_off

    shape = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2) if quick else dict(hidden_size=512, intermediate_size=1536,
                                                           num_hidden_layers=6, num_attention_heads=8,
                                                           num_key_value_heads=2)
    config = Qwen2Config(vocab_size=VOCAB_SIZE, max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, **shape)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID)
    with hf_progress_bars_off():
        model.save_pretrained(out, safe_serialization=True)
    tokenizer = build_tokenizer()
    assert len(tokenizer) == VOCAB_SIZE, len(tokenizer)
    tokenizer.save_pretrained(out)


def prompt_texts(count: int) -> list[str]:
    """Questions of varied length, each marked ``Q<i>:`` so the oracle can tell them apart."""
    words = "please add these two numbers and give only the result".split()
    return [f"Q{i}: {' '.join(words[: 2 + (i * 5) % len(words)])}: {7 ** (i % 9) + i} + {3 * i + 1}?"
            for i in range(count)]


def target_lengths(prompts: int, n: int, median: float, sigma: float, cap: int, seed: int = 0) -> list[list[int]]:
    """Response lengths (prompts x n), EOS included: lognormal(log median, sigma) in [1, cap]."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn((prompts, n), generator=generator, dtype=torch.float64)
    return (math.log(median) + sigma * normal).exp().round().clamp(1, cap).long().tolist()


def force_lengths(logits, generated, targets):
    """No EOS before a row's target length, only EOS at it. generated/targets (B,)."""
    import torch

    logits = logits.clone()
    at_target = (generated + 1 >= targets)[:, None]
    eos_only = torch.full_like(logits, float("-inf"))
    eos_only[:, EOS_TOKEN_ID] = 0.0
    logits[:, EOS_TOKEN_ID] = float("-inf")
    return torch.where(at_target, eos_only, logits)


# --------------------------------------------------------------------------------------------
# Workers (one configuration each, in a subprocess)
# --------------------------------------------------------------------------------------------


class ChildRSS:
    """Peak summed RSS of this process's descendants, sampled every 50 ms from /proc."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _descendants_rss() -> int:
        parents: dict[int, int] = {}
        rss: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                parents[int(entry)] = int(fields[1])
                rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError, IndexError):
                continue
        me, total, frontier = os.getpid(), 0, [os.getpid()]
        while frontier:
            parent = frontier.pop()
            for pid, ppid in parents.items():
                if ppid == parent and pid != me:
                    total += rss.get(pid, 0)
                    frontier.append(pid)
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._descendants_rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


RSS_PEAK = "perf/rss_peak_gb/"  # hybridflow's per-phase peak resident memory (hybridflow.utils.timer)


def own_peak_rss_bytes() -> int:
    """This process's peak resident memory. hybridflow resets the kernel's high-water mark at each
    phase boundary (its per-phase peaks), after which ``ru_maxrss`` reports only the peak since the
    last reset: ask its tracker, which keeps the whole run's (getattr: older source trees have none)."""
    tracker = getattr(sys.modules.get("hybridflow.utils.memory"), "RSS_PEAKS", None)
    if tracker is not None:
        return tracker.process_peak_bytes()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_hybridflow(spec: dict) -> dict:
    from hybridflow.controller.setup import build_run
    from hybridflow.controller.loops import make_trainer

    targets = spec["targets"]

    def oracle(logits, rows):
        import torch

        prompt_rows = [int(r.rsplit(":", 1)[1]) for r in rows.request_ids]
        wanted = torch.tensor([targets[p][s] for p, s in zip(prompt_rows, rows.sample_indices)])
        return force_lengths(logits, rows.output_lengths, wanted)

    cfg = hybridflow_config(spec)
    run = build_run(cfg)
    try:
        run.roles.rollout.groups[0]._workers[0].engine._runner.logits_processors = (oracle,)
        trainer = make_trainer(run)
        steps = []
        for _ in range(spec["warmup"] + spec["steps"]):
            trainer.step += 1
            cpu = time.process_time()
            metrics = trainer.loop.train_step(trainer.step)
            steps.append({"step": metrics["timing_s/step"], "gen": metrics["timing_s/gen"],
                          "cpu": time.process_time() - cpu,
                          "rss_gb": {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if k.startswith(RSS_PEAK)},
                          "timing": {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if k.startswith("timing_s/")}})
        # (getattr: the bench also runs against older source trees, PYTHONPATH=<tree>, for before/after figures)
        plan = getattr(run.roles.actor._workers[0], "plan", None)
        notes = list(plan.notes) if plan is not None else ["(a source tree without micro-batch plans)"]
    finally:
        run.close()
    return {"steps": steps[spec["warmup"]:], "notes": notes}


# What an AVX2-only CPU (no AVX-512, no bf16 hardware) would run, emulated on a newer CPU: oneDNN (the
# bf16 and packed matmuls), MKL (the fp32 matmuls) and ATen's own kernels capped at AVX2. The cores'
# speed per instruction stays this CPU's, so it is a figure for the kernels, not for another machine.
ISA_CAPS = {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def auto_dtype() -> str:
    """What hybridflow's default ``model.dtype=auto`` trains in on this machine (and why)."""
    from hybridflow.utils.device import rule_train_dtype

    dtype, why = rule_train_dtype("cpu")
    return f"{dtype}: {why}"


def hybridflow_config(spec: dict):
    """hybridflow's config for the workload: the defaults, the workload's sizes, ``spec["overrides"]``."""
    from hybridflow import api

    work = Path(spec["work"])
    overrides = [
        f"model.path={work / 'model'}", f"data.train_files=[{work / 'prompts.jsonl'}]",
        f"data.max_prompt_length={spec['max_prompt_length']}", f"data.max_response_length={spec['max_tokens']}",
        f"data.train_batch_size={spec['prompts']}", f"actor.ppo_mini_batch_size={spec['prompts']}",
        f"rollout.n={spec['n']}", "data.shuffle=false", "warm_start.enable=false",
        # The default sample counts (64, 128), or the whole step when it is smaller (--quick).
        f"actor.ppo_micro_batch_size_per_gpu={min(64, spec['prompts'] * spec['n'])}",
        f"actor.log_prob_micro_batch_size_per_gpu={min(128, spec['prompts'] * spec['n'])}",
        f"trainer.total_training_steps={spec['warmup'] + spec['steps']}", "trainer.val_before_train=false",
        "trainer.test_freq=0", "trainer.save_freq=0", "trainer.save_final=false", "trainer.logger=[]",
        "trainer.progress_bar=false", f"trainer.num_threads={spec['threads']}", f"trainer.output_dir={work / 'out'}",
        f"actor.optim.lr={LR}", "actor.optim.weight_decay=0.0", f"reward.custom_reward_function.path={work / 'reward.py'}",
        *(["actor.use_kl_loss=true", f"actor.kl_loss_coef={KL_COEF}", "actor.kl_loss_type=low_var_kl"]
          if spec["kl"] else []),
        *spec["overrides"],
    ]
    return api.make_config("grpo", overrides=overrides)


def run_trl(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import LogitsProcessor, LogitsProcessorList, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    work = Path(spec["work"])
    targets = spec["targets"]
    namespace: dict = {}
    exec(REWARD_SOURCE, namespace)
    score = namespace["score"]

    def reward(completions, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score(t) for t in texts]

    reward.__name__ = "length_mod_3"

    tokenizer_holder: dict = {}

    class Oracle(LogitsProcessor):
        def __init__(self, rows: list[int], prompt_width: int) -> None:
            self.targets = torch.tensor(rows)
            self.prompt_width = prompt_width

        def __call__(self, input_ids, scores):
            generated = torch.full((scores.shape[0],), input_ids.shape[1] - self.prompt_width)
            return force_lengths(scores, generated, self.targets)

    gen_seconds: dict[int, float] = {}  # optimizer step -> seconds in generate
    gen_cpu: dict[int, float] = {}  # optimizer step -> this process's CPU-seconds in generate
    current = {"step": 0}

    def patch_generate(model) -> None:
        original = model.generate

        def generate(*args, **kwargs):
            input_ids = kwargs["input_ids"]
            tokenizer = tokenizer_holder["tok"]
            seen: dict[int, int] = {}
            rows = []
            for row in input_ids.tolist():
                prompt = int(PROMPT_MARK.search(tokenizer.decode(row)).group(1))
                rows.append(targets[prompt][seen.get(prompt, 0)])
                seen[prompt] = seen.get(prompt, 0) + 1
            processors = LogitsProcessorList([Oracle(rows, input_ids.shape[1])])
            start, cpu = time.perf_counter(), time.process_time()
            out = original(*args, **kwargs, logits_processor=processors)
            gen_seconds[current["step"]] = gen_seconds.get(current["step"], 0.0) + time.perf_counter() - start
            gen_cpu[current["step"]] = gen_cpu.get(current["step"], 0.0) + time.process_time() - cpu
            return out

        model.generate = generate

    step_ends: list[tuple[float, float]] = []  # (wall, CPU) at each step's end, the first step's start first

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            current["step"] = state.global_step
            if not step_ends:
                step_ends.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append((time.perf_counter(), time.process_time()))

    per_step = spec["prompts"] * spec["n"]
    trl = CONFIGS[spec["config"]]
    micro = min(trl["per_device_train_batch_size"], per_step)
    args = GRPOConfig(
        output_dir=str(work / f"trl-{os.getpid()}"), per_device_train_batch_size=micro,
        gradient_checkpointing=trl["gradient_checkpointing"],
        gradient_accumulation_steps=per_step // micro, num_generations=spec["n"],
        max_completion_length=spec["max_tokens"], learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=1.0, bf16=trl.get("bf16", False), use_cpu=True, beta=KL_COEF if spec["kl"] else 0.0, temperature=1.0,
        top_p=1.0, top_k=0, max_steps=spec["warmup"] + spec["steps"], logging_steps=1, save_strategy="no",
        report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True, shuffle_dataset=False,
        model_init_kwargs={"dtype": torch.float32},
    )
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": text}]} for text in spec["prompt_texts"]])
    trainer = GRPOTrainer(model=str(work / "model"), reward_funcs=reward, args=args, train_dataset=dataset,
                          callbacks=[StepClock()])
    tokenizer_holder["tok"] = trainer.processing_class
    patch_generate(trainer.model)
    trainer.train()
    steps = []
    for i in range(1, len(step_ends)):
        steps.append({"step": step_ends[i][0] - step_ends[i - 1][0], "gen": gen_seconds.get(i - 1, 0.0),
                      "cpu": step_ends[i][1] - step_ends[i - 1][1], "gen_cpu": gen_cpu.get(i - 1, 0.0)})
    return {"steps": steps[spec["warmup"]:], "notes": [f"per_device_train_batch_size={micro}, "
                                                       f"gradient_checkpointing={args.gradient_checkpointing}"]}


def worker_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    children = ChildRSS()
    result = run_trl(spec) if spec["config"].startswith("trl") else run_hybridflow(spec)
    result["peak_rss_gb"] = (own_peak_rss_bytes() + children.stop()) / 1e9
    print("RESULT " + json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------------
# The parent: build the workload, alternate the configurations, print the table
# --------------------------------------------------------------------------------------------


def run_config(spec: dict, work: Path) -> dict:
    path = work / f"spec-{spec['config']}-{int(spec['kl'])}.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, __file__, "--worker", str(path)], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{spec['config']} (kl={spec['kl']}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 prompts x 4, cap 32: a smoke run")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--kl", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--kl-configs", nargs="+", default=["trl", "defaults", "padded"], choices=list(CONFIGS),
                        help="configurations also run with the KL reference (--kl on)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--median-tokens", type=float, default=32.0)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--isa", choices=["native", "avx2"], default="native",
                        help="avx2: cap every kernel library at AVX2 (ISA_CAPS), an AVX2-only CPU's kernels on this one")
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker)
        return
    if args.isa == "avx2":
        os.environ.update(ISA_CAPS)  # the workers inherit it; hybridflow's dtype rule reads oneDNN's cap
    if args.quick:
        args.prompts, args.n, args.max_tokens, args.median_tokens = 4, 4, 32, 8.0
        args.steps, args.repeats = 1, 1

    work = Path(tempfile.mkdtemp(prefix="grpo-step-vs-trl-"))
    write_model(work / "model", args.quick)
    texts = prompt_texts(args.prompts)
    with open(work / "prompts.jsonl", "w") as out:
        for i, text in enumerate(texts):
            out.write(json.dumps({"data_source": "bench", "prompt": [{"role": "user", "content": text}],
                                  "ability": "bench", "reward_model": {"style": "rule", "ground_truth": "0"},
                                  "extra_info": {"index": i}}) + "\n")
    (work / "reward.py").write_text(REWARD_SOURCE)
    targets = target_lengths(args.prompts, args.n, args.median_tokens, args.sigma, args.max_tokens)
    flat = sorted(t for row in targets for t in row)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"workload: {'quick: ~0.5M' if args.quick else '~18M'} Qwen2-shaped model (vocab {VOCAB_SIZE}), "
          f"{args.prompts} prompts x n={args.n}, lognormal response lengths (median {args.median_tokens:g}, "
          f"sigma {args.sigma:g}, cap {args.max_tokens}: mean {statistics.mean(flat):.1f}, max {flat[-1]}, "
          f"{sum(flat)} tokens), {args.threads} thread(s), AdamW lr {LR:g}, one optimizer step per batch; TRL in "
          f"fp32 (trl_bf16: bf16=True), hybridflow in its default model.dtype=auto ({auto_dtype()})")
    caps = f" (kernels capped: {' '.join(f'{k}={v}' for k, v in ISA_CAPS.items())})" if args.isa == "avx2" else ""
    print(f"cpu: {cpu}{caps}, {os.cpu_count()} cores; {args.warmup} warm-up + {args.steps} timed step(s) per run, "
          f"median over {args.repeats} alternating round(s)")

    base = dict(work=str(work), prompts=args.prompts, n=args.n, max_tokens=args.max_tokens,
                max_prompt_length=128, threads=args.threads, warmup=args.warmup, steps=args.steps,
                targets=targets, prompt_texts=texts)
    plans = [(config, kl == "on") for kl in args.kl for config in args.configs
             if kl == "off" or config in args.kl_configs]
    results: dict[tuple[str, bool], list[dict]] = {plan: [] for plan in plans}
    for round_ in range(args.repeats):
        for config, kl in plans:
            spec = dict(base, config=config, kl=kl, overrides=[] if config.startswith("trl") else CONFIGS[config])
            result = run_config(spec, work)
            results[(config, kl)].append(result)
            step = statistics.median(s["step"] for s in result["steps"])
            gen = statistics.median(s["gen"] for s in result["steps"])
            cpu = statistics.median(s["cpu"] for s in result["steps"])
            print(f"  round {round_ + 1}: {config:13s} kl={'on ' if kl else 'off'} {step:7.2f} s/step  "
                  f"{cpu:7.2f} CPU-s/step  (generation {gen:.2f})  peak RSS {result['peak_rss_gb']:.2f} GB", flush=True)

    tokenizer = build_tokenizer()
    prompt_tokens = [len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                                                        add_generation_prompt=True, tokenize=False),
                                          add_special_tokens=False)) for t in texts]
    tokens = sum(flat) + args.n * sum(prompt_tokens)  # prompt + response tokens of one step
    for kl in sorted({kl for _, kl in plans}):
        print(f"\nKL reference: {'on (k3, coef 0.04)' if kl else 'off'}")
        print(f"| {'':44s} | s/step | CPU-s/step | generation | update | tokens/s | peak RSS | vs TRL s/step "
              f"| vs TRL CPU-s | vs TRL RSS |")
        print(f"|{'-' * 46}|-------:|-----------:|-----------:|-------:|---------:|---------:|--------------:"
              f"|-------------:|-----------:|")
        rows = {}
        for config, plan_kl in plans:
            if plan_kl != kl:
                continue
            runs = results[(config, kl)]
            step = statistics.median(statistics.median(s["step"] for s in r["steps"]) for r in runs)
            gen = statistics.median(statistics.median(s["gen"] for s in r["steps"]) for r in runs)
            cpu = statistics.median(statistics.median(s["cpu"] for s in r["steps"]) for r in runs)
            rss = statistics.median(r["peak_rss_gb"] for r in runs)
            rows[config] = (step, cpu, gen, rss)
        trl = rows.get("trl")
        for config, (step, cpu, gen, rss) in rows.items():
            ratio = f"{trl[0] / step:12.2f}x" if trl else " " * 13
            cpu_ratio = f"{trl[1] / cpu:11.2f}x" if trl else " " * 12
            rss_ratio = f"{rss / trl[3]:9.2f}x" if trl else " " * 10
            print(f"| {LABELS[config]:44s} | {step:6.2f} | {cpu:10.2f} | {gen:10.2f} | {step - gen:6.2f} | "
                  f"{tokens / step:8.0f} | {rss:5.2f} GB | {ratio} | {cpu_ratio} | {rss_ratio} |")
        if trl:
            print("ratios: TRL's / the config's s/step and CPU-s/step (>1: faster than TRL); config RSS / TRL RSS "
                  "(<1: smaller). CPU-s: the worker process's own (every thread), which another process's load "
                  "moves less than wall time")
    print()
    for config in args.configs:
        runs = results.get((config, False)) or results.get((config, True))
        if runs:
            print(f"{LABELS[config]}: " + "; ".join(runs[0]["notes"]))
    print(f"work dir: {work}")


if __name__ == "__main__":
    main()
