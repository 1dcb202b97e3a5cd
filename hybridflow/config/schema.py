"""The typed configuration schema: one dataclass per area, a help text per field.

Key names follow verl where a verl user would look for them (``data.train_batch_size``,
``actor.ppo_mini_batch_size``, ``rollout.n``, ``algorithm.adv_estimator`` ...). The defaults
are the embedded default run: the built-in tiny model on the built-in arithmetic task, on CPU.

Batch-size units (the usual source of confusion, stated once here):
- ``data.train_batch_size`` and ``actor.ppo_mini_batch_size`` count *prompts*;
  each prompt yields ``rollout.n`` samples.
- ``*_micro_batch_size_per_gpu`` counts *samples* on one data-parallel rank.

Each section lives in ``hybridflow/config/sections/<area>.py``; this module assembles them into
``Config`` and keeps every section class importable from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.config.sections.distillation import DistillationConfig, TeacherConfig, TeacherServerConfig
from hybridflow.config.sections.dpo import DPOConfig
from hybridflow.config.fields import sub
from hybridflow.config.sections.rm import RMConfig
from hybridflow.config.sections.prime import PrimeConfig, PrimeModelConfig

# The section classes are re-exported: ``from hybridflow.config.schema import ActorConfig`` stays the
# public path wherever a section is used.
from hybridflow.config.sections.data import (
    SamplerConfig,
    DataConfig,
)
from hybridflow.config.sections.model import (
    ModelConfig,
    WarmStartConfig,
    SFTConfig,
)
from hybridflow.config.sections.actor import (
    OptimConfig,
    PolicyLossConfig,
    FSDPConfig,
    LoraConfig,
    ActorConfig,
    RefConfig,
    CriticModelConfig,
    CriticConfig,
)
from hybridflow.config.sections.rollout import (
    ValKwargsConfig,
    MultiTurnConfig,
    RolloutConfig,
)
from hybridflow.config.sections.reward import (
    CustomRewardConfig,
    OverlongBufferConfig,
    SandboxFusionConfig,
    RewardConfig,
    RewardModelModelConfig,
    JudgeConfig,
    RewardModelConfig,
    DEFAULT_JUDGE_TEMPLATE,
)
from hybridflow.config.sections.algorithm import (
    KLControlConfig,
    FilterGroupsConfig,
    OnlineDPOConfig,
    RolloutCorrectionConfig,
    AlgorithmConfig,
)
from hybridflow.config.sections.trainer import (
    HealthConfig,
    AsyncTrainingConfig,
    ProfileConfig,
    TrainerConfig,
    StorageConfig,
)


@dataclass
class Config:
    data: DataConfig = sub(DataConfig, "Datasets and lengths.")
    model: ModelConfig = sub(ModelConfig, "The policy model.")
    warm_start: WarmStartConfig = sub(WarmStartConfig, "Supervised warm start for the built-in model.")
    sft: SFTConfig = sub(SFTConfig, "Supervised fine-tuning (hybridflow sft).")
    dpo: DPOConfig = sub(DPOConfig, "Direct preference optimisation (hybridflow dpo).")
    rm: RMConfig = sub(RMConfig, "Reward-model training (hybridflow rm).")
    actor: ActorConfig = sub(ActorConfig, "Policy optimisation.")
    ref: RefConfig = sub(RefConfig, "Reference model (for KL).")
    critic: CriticConfig = sub(CriticConfig, "Value model (built when algorithm.adv_estimator needs values: gae).")
    rollout: RolloutConfig = sub(RolloutConfig, "Generation.")
    reward: RewardConfig = sub(RewardConfig, "Reward scoring.")
    reward_model: RewardModelConfig = sub(RewardModelConfig, "Reward model (discriminative or generative judge).")
    algorithm: AlgorithmConfig = sub(AlgorithmConfig, "Advantage estimation and KL in reward.")
    distillation: DistillationConfig = sub(DistillationConfig, "On-policy distillation from teacher models.")
    prime: PrimeConfig = sub(PrimeConfig, "PRIME's implicit process reward model (algorithm.adv_estimator=prime).")
    trainer: TrainerConfig = sub(TrainerConfig, "Loop, logging, checkpoints.")
    async_training: AsyncTrainingConfig = sub(AsyncTrainingConfig, "The asynchronous loops (trainer.mode).")
    storage: StorageConfig = sub(StorageConfig, "Object storage (s3://, gs://, other fsspec URLs) for data, model and checkpoints.")


def key_value(cfg: Any, dotted: str) -> Any:
    """The value at a dotted key (``actor.optim.lr``) of a config or one of its sections."""
    value = cfg
    for name in dotted.split("."):
        value = getattr(value, name)
    return value
