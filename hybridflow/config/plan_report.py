"""The memory plan as ``config explain`` and ``hybridflow plan`` print it: a table of each role's
predicted peak per phase (``config.plan.plan_memory``) and, for a phase that does not fit the
device, a warning with its cheapest fix. Kept apart from the arithmetic so the planner module holds
the model of memory alone."""

from __future__ import annotations

from hybridflow.config.schema import Config
from hybridflow.config.budget import read_model_shape
from hybridflow.config.plan import GIB, MemoryPlan, plan_memory


COLUMNS = ("params", "grads", "optim", "activ", "logits", "kv", "others", "peak")


def format_memory_plan(plan: MemoryPlan) -> list[str]:
    """The table (GiB per rank, MiB when everything is smaller than a GiB) and, per phase that
    does not fit, a warning and its fix."""
    largest = max([p.peak for p in plan.phases] + [plan.device_bytes or 0])
    unit, scale = ("GiB", GIB) if largest >= GIB else ("MiB", 2**20)

    def cell(n: int) -> str:
        return "-" if n == 0 else f"{n / scale:.2f}"

    device = "trainer.device_memory_gb unset: peaks only, no fit check" if plan.device_bytes is None else \
        f"device {plan.device_bytes / scale:.2f} {unit} (trainer.device_memory_gb)"
    lines = [f"predicted peak memory per rank, {unit}; {device}",
             f"{'role':<10}{'phase':<17}" + "".join(f"{c:>9}" for c in COLUMNS) + "  fits"]
    for p in plan.phases:
        values = (p.params, p.grads, p.optimizer, p.activations, p.logits, p.kv_cache, p.others, p.peak)
        fits = "" if plan.device_bytes is None else ("yes" if p.peak <= plan.device_bytes and not p.blocked else "NO")
        lines.append(f"{p.role:<10}{p.phase:<17}" + "".join(f"{cell(v):>9}" for v in values) + f"  {fits}")
    lines.append("others: what the other roles on the device keep resident meanwhile (colocated). The peak counts "
                 "activ and logits once where they take turns (forwards; the head's and a layer's backward)")
    lines += [f"{p.role} {p.phase}: {'; '.join(p.notes)}" for p in plan.phases if p.notes]
    lines += plan.notes
    for p in plan.too_big():
        assert plan.device_bytes is not None
        why = (f"needs {p.peak / scale:.2f} {unit}, more than the device's {plan.device_bytes / scale:.2f} {unit}"
               if p.peak > plan.device_bytes else f"cannot run: {p.blocked}")
        lines.append(f"WARNING: {p.role} {p.phase} {why}. Cheapest fix: {plan.fixes.get((p.role, p.phase), '?')}")
    return lines


def memory_plan_lines(cfg: Config, with_critic: bool = False) -> list[str]:
    """The plan for ``cfg``'s model, or why it cannot be made yet."""
    shape = read_model_shape(cfg.model.path, None if cfg.data.train_files else cfg.data.builtin_task)
    if shape is None:
        return [f"memory: {cfg.model.path}/config.json is not readable now; planned at start-up"]
    return format_memory_plan(plan_memory(cfg, shape, with_critic=with_critic))
