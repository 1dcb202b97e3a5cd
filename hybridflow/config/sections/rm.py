"""``hybridflow rm``'s own settings (the ``rm`` section): the reward model's loss and its length.

Everything else it reads is a shared key: model.path (the model it starts from: a causal LM gets a new
one-label head, a reward model keeps its own), data.train_files / val_files, data.prompt_key and the pair
columns and built-in pairs of ``hybridflow dpo`` (dpo.chosen_key, dpo.rejected_key, dpo.builtin_samples,
dpo.builtin_val_prompts; the number of training prompts is rm.builtin_prompts, so the reward model's data
grows without changing DPO's), data.train_batch_size (pairs per step), actor.optim, actor.fsdp_config,
packing and micro-batching (counted in pairs), trainer.* (checkpoints, resume, test_freq).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.fields import f


@dataclass
class RMConfig:
    """``hybridflow rm``: a reward model (a one-label sequence classifier) trained on preference pairs."""

    center_rewards_coefficient: float = f(
        0.0, "c >= 0: adds c x (r_chosen + r_rejected)² to the Bradley-Terry loss, which keeps the scores centred "
        "on 0 (their offset is otherwise free). TRL's RewardConfig.center_rewards_coefficient.",
    )
    max_length: int | None = f(
        None, "Most tokens of a rendered prompt + response; a longer one loses tokens from its start, as the "
        "reward model role cuts it when it scores (reward_model.max_length: set both alike). None: the model's "
        "max_position_embeddings, the role's default.",
    )
    builtin_teacher_steps: int = f(
        200, "With the built-in pairs (model.path=builtin:tiny, no data.train_files) the reward model starts from "
        "the built-in teacher: the warm-started model trained this many more SFT steps on the task's correct "
        "answers (200: distillation's builtin:tiny-teacher, one cached model). It computes the sums the pairs' "
        "answers differ in, which the warm start (trained on a teacher's slips) does less reliably: 0.82 "
        "held-out pair accuracy against 0.73 in the default run at rm.head_lr=null. The pairs are still the warm "
        "start's own. 0: start from the warm start itself.",
    )
    head_lr: float | None = f(
        1e-2, "Peak learning rate of the new one-label head (the schedule of actor.optim scales it alike); the "
        "body keeps actor.optim.lr. The head starts at zero and Adam moves each weight about lr per step, so at "
        "the body's lr it is what limits the first hundred steps (a score margin under 1 at step 100 on the "
        "built-in pairs). None: actor.optim.lr.",
    )
    builtin_prompts: int = f(
        1024, "Training prompts of the built-in pairs hybridflow rm trains on (no data.train_files, model.path="
        "builtin:tiny), at most the task's 5,026 training questions; dpo.builtin_prompts is DPO's, so the reward "
        "model's data grows without changing DPO's. Each prompt gives a pair (the right answer against the warm "
        "start's first wrong sample); the held-out pairs stay dpo.builtin_val_prompts' 256 whatever this is. In "
        "the default 100 steps 1024 and 4096 rank the held-out pairs alike (0.852, 0.844); over steps 200-300 4096 "
        "gives 0.86-0.89, where with 1024 the model fits its training pairs (0.95) better than the held-out ones "
        "(0.85).",
    )
    extra_layers: int = f(
        0, "Decoder layers added on top of the start model's, each a copy of its last layer with its two outputs "
        "to the residual stream (attention's o_proj, the MLP's down_proj) zeroed, so the model starts computing "
        "exactly what it did and the head reads a layer trained for scoring (real reward models put a learned "
        "layer before the score). The export is an ordinary model of the same family with more layers. "
        "Llama-style layers only (Qwen, Llama, Mistral). On the built-in pairs (4096 prompts, 300 steps) one "
        "layer gave 0.875 held-out pair accuracy against 0.871 without, two 0.867: within the noise between "
        "neighbouring validations (±0.02-0.03), so 0 by default. Where the pairs are mostly one-digit slips "
        "(an AMD EPYC Zen 4's) two layers are what learn the check, over 1,000 steps: hybridflow rm --preset builtin.",
    )
    export: bool = f(True, "Write the final reward model as a Hugging Face directory in <output_dir>/export, "
                           "what reward_model.model.path loads.")
