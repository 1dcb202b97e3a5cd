"""The batch arithmetic of the actor and the critic: mini-batches that divide the step, samples that split
evenly over the ranks, micro-batches that divide a rank's share. A bad split is the classic silent
failure (zero gradient-accumulation steps, a NaN loss: verl #2505), so every message states the
numbers and a value that would work."""

from __future__ import annotations

from hybridflow.config.checks.ranges import check_optim
from hybridflow.config.checks.report import Report, divisors_near, multiples_near, or_list
from hybridflow.config.layout import data_parallel_size, dp_source
from hybridflow.config.schema import Config


def check_critic(cfg: Config, report: Report) -> None:
    """The ``critic`` section. Checked whatever the estimator: its defaults always pass, and a
    value set wrong is wrong before a run switches to gae."""
    critic = cfg.critic
    check_optim("critic.optim", critic.optim, report)
    if not critic.cliprange_value >= 0:
        report.error(
            f"critic.cliprange_value={critic.cliprange_value} must be >= 0: a new value may move at most this far "
            f"from the rollout's value before its error stops counting (verl's default is 0.5)"
        )
    if cfg.trainer.critic_warmup < 0:
        report.error(f"trainer.critic_warmup={cfg.trainer.critic_warmup} must be >= 0 steps")
    train, n, dp = cfg.data.train_batch_size, cfg.rollout.n, data_parallel_size(cfg.trainer)
    own = critic.ppo_mini_batch_size
    # null: the actor's mini-batch, whose split check_batches reports.
    mini = own if own is not None else cfg.actor.ppo_mini_batch_size
    if min(train, n, dp, mini, critic.ppo_micro_batch_size_per_gpu) < 1:
        return  # reported by check_ranges or below
    if own is not None and (mini > train or train % mini):
        report.error(
            f"critic.ppo_mini_batch_size={mini} prompts must divide data.train_batch_size={train} prompts (e.g. "
            f"{or_list(divisors_near(train, mini))}), or be null for actor.ppo_mini_batch_size"
        )
    elif mini * n % dp:
        if own is not None:
            report.error(
                f"a critic mini-batch of critic.ppo_mini_batch_size={mini} prompts x rollout.n={n} samples cannot be "
                f"split evenly over {dp} data-parallel ranks; make it a multiple of {dp}"
            )
    elif not critic.use_dynamic_bsz and (mini * n // dp) % critic.ppo_micro_batch_size_per_gpu:
        per_rank = mini * n // dp
        report.error(
            f"each rank gets {per_rank} samples per critic optimizer step, which is not a multiple of "
            f"critic.ppo_micro_batch_size_per_gpu={critic.ppo_micro_batch_size_per_gpu}; use one that divides "
            f"{per_rank}, e.g. {or_list(divisors_near(per_rank, critic.ppo_micro_batch_size_per_gpu))}"
        )


def check_batches(cfg: Config, report: Report) -> None:
    """The batch arithmetic, each message with its numbers. Skipped when a size is not positive
    (already reported by ``check_ranges``) to avoid dividing by zero."""
    train = cfg.data.train_batch_size
    mini = cfg.actor.ppo_mini_batch_size
    micro = cfg.actor.ppo_micro_batch_size_per_gpu
    n = cfg.rollout.n
    dp = data_parallel_size(cfg.trainer)
    if min(train, mini, micro, n, dp) < 1:
        return
    dp_text = f"dp={dp} data-parallel ranks ({dp_source(cfg.trainer)})"

    # Online DPO steps over pairs, however many the rewards give: no mini-batches of samples to check.
    if cfg.actor.loss != "dpo":
        _check_mini_batches(cfg, report, dp, dp_text)

    if not cfg.data.train_files and cfg.data.builtin_train_size < train:
        report.error(
            f"data.builtin_train_size={cfg.data.builtin_train_size} prompts is smaller than "
            f"data.train_batch_size={train}: an epoch of the built-in task would not fill one step"
        )


def _check_mini_batches(cfg: Config, report: Report, dp: int, dp_text: str) -> None:
    """Mini-batches of prompts and micro-batches of samples against the step and the ranks."""
    train, mini, micro, n = (cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size,
                             cfg.actor.ppo_micro_batch_size_per_gpu, cfg.rollout.n)
    if mini > train:
        report.error(
            f"actor.ppo_mini_batch_size={mini} prompts is larger than data.train_batch_size={train} prompts: "
            f"a step would never fill one mini-batch; use ppo_mini_batch_size <= {train}, e.g. "
            f"{or_list(divisors_near(train, mini))}"
        )
    elif train % mini:
        report.error(
            f"data.train_batch_size={train} prompts is not a multiple of actor.ppo_mini_batch_size={mini} "
            f"prompts: each step would leave {train % mini} prompts untrained; use a ppo_mini_batch_size "
            f"that divides {train} (e.g. {or_list(divisors_near(train, mini))}) or a train_batch_size "
            f"that is a multiple of {mini} (e.g. {or_list(multiples_near(mini, train))})"
        )

    mini_samples = mini * n
    if mini_samples % dp:
        report.error(
            f"a mini-batch of actor.ppo_mini_batch_size={mini} prompts x rollout.n={n} = {mini_samples} "
            f"samples cannot be split evenly over {dp_text}; make ppo_mini_batch_size x rollout.n a "
            f"multiple of {dp}"
        )
    else:
        step_samples = train * n
        if step_samples % dp:
            report.error(
                f"a step of data.train_batch_size={train} prompts x rollout.n={n} = {step_samples} samples "
                f"cannot be split evenly over {dp_text}; make train_batch_size x rollout.n a multiple of {dp}"
            )
        per_rank = mini_samples // dp
        share = f"ppo_mini_batch_size={mini} prompts x rollout.n={n} / dp={dp}"
        # With actor.use_dynamic_bsz the token budget forms the micro-batches; the sample count is unused.
        fixed_micro = not cfg.actor.use_dynamic_bsz
        if fixed_micro and micro > per_rank:
            report.error(
                f"actor.ppo_micro_batch_size_per_gpu={micro} samples is larger than the {per_rank} samples "
                f"each rank gets per optimizer step ({share}): there would be no full micro-batch "
                f"(0 gradient-accumulation steps); use ppo_micro_batch_size_per_gpu <= {per_rank} that divides "
                f"it, e.g. {or_list(divisors_near(per_rank, micro))}"
            )
        elif fixed_micro and per_rank % micro:
            report.error(
                f"each rank gets {per_rank} samples per optimizer step ({share}), which is not a multiple of "
                f"actor.ppo_micro_batch_size_per_gpu={micro}: the last micro-batch would hold "
                f"{per_rank % micro} samples; use a micro-batch size that divides {per_rank}, e.g. "
                f"{or_list(divisors_near(per_rank, micro))}"
            )
