"""Measure how many of verl's example training command lines ``hybridflow config explain`` accepts.

verl's users arrive with its ``examples/**/*.sh`` scripts. This tool expands each script as bash
would (variables and their defaults, line continuations, ``$@``) by running it under bash with a
``python3`` that only records its arguments, replaces the model, LoRA adapter and data paths with local
ones (small random-init model directories, a PEFT adapter of the policy, a small parquet file), and runs ``hybridflow config explain`` on the
result in this process. Each script is then:

- ``pass``: explained, exit 0, nothing missing on this machine;
- ``machine``: explained, exit 0, with "cannot run here: ..." lines (no GPU, vLLM not installed);
- ``refused``: exit 2 (or another failure), with its first error;
- ``not-run``: the script never launched verl's trainer under the stub (it needs something else).

and the totals are split by FSDP vs Megatron. It is a measuring tool, not a test::

    python scripts/verl_examples.py                        # verl's mirror (git objects), HEAD
    python scripts/verl_examples.py --verl ~/src/verl      # a verl work tree
    python scripts/verl_examples.py -k grpo -v             # scripts whose path holds 'grpo', with errors

Nothing of verl's runs but the shell scripts themselves, under a PATH of stubs and a few text
utilities, with HOME and the working directory in a scratch folder: ``python``/``python3`` record
their argv as JSON and exit, and downloads, ``ray``, ``pip``, ``conda`` and ``sleep`` do nothing.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

MIRROR = Path("/work/.mirror/volcengine+verl/repo")
"""verl's git objects on the project's machines (no work tree): read with git archive."""

TRAINER_MODULES = ("verl.trainer.main_ppo",)
"""The Python modules whose launch is verl's RL trainer; other scripts (SFT, generation) are not counted."""

CLUSTER_ENV = {"SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1", "ARNOLD_WORKER_NUM": "1", "ARNOLD_WORKER_GPU": "8",
               "GPUS_PER_NODE": "8", "NNODES": "1", "SLURM_GPUS_PER_NODE": "8"}
"""What a one-node cluster's scheduler sets, for scripts that read the node count from it."""

RECORDED_COMMANDS = ("python", "python3", "ray", "srun", "torchrun")
"""Commands that may launch verl's trainer (``ray job submit -- python3 -m ...``): each records its argv."""

NOOP_COMMANDS = ("pip", "pip3", "conda", "huggingface-cli", "hf", "modelscope", "wget", "curl", "git",
                 "nvidia-smi", "sleep", "sbatch", "rm", "ln", "cp", "mv", "chmod", "kill", "source")
"""Commands the scripts call that must not run here: each is a stub that does nothing."""

STRICT_OFF = 'set() { builtin set "$@"; builtin set +eu; }; source "$0" "$@"'
"""Runs the script with ``set -e`` and ``set -u`` kept off: a missing cluster variable (SLURM_*) or a
failed stub must not stop it before it reaches the trainer's command line."""

TEXT_UTILITIES = ("date", "dirname", "basename", "realpath", "readlink", "cat", "head", "tail", "tr", "cut", "seq",
                  "expr", "awk", "sed", "grep", "wc", "mkdir", "env", "nproc", "hostname", "whoami", "ls", "uname",
                  "sort", "tee", "id", "touch", "printf", "true", "false", "bc")
"""Harmless programs the scripts use to compute names and paths; linked into the stub PATH."""

RECORDER = """#!{python}
import json, os, sys
with open(os.environ["VERL_EXAMPLES_RECORD"], "a", encoding="utf-8") as out:
    out.write(json.dumps(sys.argv[1:]) + "\\n")
"""

NOOP = "#!/bin/sh\nexit 0\n"

SCRIPT_TIMEOUT_S = 20


@dataclass
class Outcome:
    script: str
    kind: str  # fsdp | megatron
    status: str  # pass | machine | refused | not-run
    error: str = ""
    machine: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # every config error explain reported


# ----------------------------------------------------------------------------------------------
# verl's files


def checkout(verl: str | None, rev: str, scratch: Path) -> Path:
    """A folder with verl's ``examples/`` and ``verl/trainer/config`` (the --config-path targets)."""
    if verl is not None and not (Path(verl) / "HEAD").is_file():
        return Path(verl).resolve()
    git_dir = Path(verl) if verl is not None else MIRROR
    root = scratch / "verl"
    root.mkdir()
    archive = subprocess.run(["git", "-C", str(git_dir), "archive", rev, "examples", "verl/trainer/config", "recipe"],
                             capture_output=True, check=False)
    if archive.returncode != 0:  # an older or newer tree without recipe/
        archive = subprocess.run(["git", "-C", str(git_dir), "archive", rev, "examples", "verl/trainer/config"],
                                 capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    return root


def example_scripts(root: Path, pattern: str | None) -> list[Path]:
    scripts = sorted(p for p in (root / "examples").rglob("*.sh") if p.is_file())
    scripts = [p for p in scripts if any(m in p.read_text(encoding="utf-8", errors="replace") for m in TRAINER_MODULES)]
    return [p for p in scripts if pattern is None or pattern in str(p.relative_to(root))]


# ----------------------------------------------------------------------------------------------
# Expanding a script as bash does


def stub_bin(scratch: Path) -> Path:
    bin_dir = scratch / "bin"
    bin_dir.mkdir()
    for name in RECORDED_COMMANDS:
        (bin_dir / name).write_text(RECORDER.format(python=sys.executable), encoding="utf-8")
    for name in NOOP_COMMANDS:
        (bin_dir / name).write_text(NOOP, encoding="utf-8")
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    for name in TEXT_UTILITIES:
        real = shutil.which(name)
        if real is not None and not (bin_dir / name).exists():
            (bin_dir / name).symlink_to(real)
    return bin_dir


def expand(script: Path, root: Path, bin_dir: Path, home: Path) -> list[list[str]]:
    """Every python argv the script ran, in order (bash did the expanding)."""
    record = home / "record.jsonl"
    record.unlink(missing_ok=True)
    env = {"PATH": str(bin_dir), "HOME": str(home), "USER": "verl", "VERL_EXAMPLES_RECORD": str(record),
           "LANG": "C.UTF-8", "TMPDIR": str(home), **CLUSTER_ENV}
    try:
        subprocess.run(["/bin/bash", "-c", STRICT_OFF, str(script)], cwd=root, env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=SCRIPT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        pass
    if not record.exists():
        return []
    return [json.loads(line) for line in record.read_text(encoding="utf-8").splitlines() if line.strip()]


def trainer_args(calls: list[list[str]]) -> list[str] | None:
    """The Hydra arguments of the first launch of verl's trainer, or None."""
    for argv in calls:
        for module in TRAINER_MODULES:
            if module in argv:
                return argv[argv.index(module) + 1:]
    return None


# ----------------------------------------------------------------------------------------------
# Local paths


_MODEL_KEY = re.compile(r"^[+~]*([\w.]*\.)?model\.(path|tokenizer_path)$")
_REWARD_MODEL_KEY = re.compile(r"^[+~]*reward_model\.model\.(path|tokenizer_path)$")
_DATA_KEY = re.compile(r"^[+~]*data\.(train_files|val_files)$")
_ADAPTER_KEY = re.compile(r"^[+~]*actor_rollout_ref\.model\.lora_adapter_path$")


@dataclass(frozen=True)
class LocalFiles:
    policy: Path  # a small causal LM directory (for the actor, reference and critic)
    reward_model: Path  # a small sequence classifier directory
    data: Path  # a parquet file in verl's row schema
    adapter: Path | None = None  # a saved PEFT LoRA adapter of the policy (lora_adapter_path)


def localize(args: list[str], local: LocalFiles) -> list[str]:
    """``args`` with every model path a local model directory and every data file a local one."""
    out = []
    for arg in args:
        key, sep, _ = arg.partition("=")
        if sep and _REWARD_MODEL_KEY.match(key):
            arg = f"{key}={local.reward_model}"
        elif sep and _MODEL_KEY.match(key):
            arg = f"{key}={local.policy}"
        elif sep and _DATA_KEY.match(key):
            arg = f"{key}={local.data}"
        elif sep and _ADAPTER_KEY.match(key) and local.adapter is not None:
            arg = f"{key}={local.adapter}"
        out.append(arg)
    return out


def write_models(folder: Path) -> tuple[Path, Path]:
    """Random-init tiny models: a context as long as verl's longest runs (64k tokens) and 8 heads, so
    the sequence-parallel sizes the scripts use divide them, as the real models' do."""
    from hybridflow.models.tiny import TinyModelSpec, write_tiny_model, write_tiny_reward_model

    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=8,
                         num_key_value_heads=8, max_position_embeddings=65536)
    return write_tiny_model(folder / "model", spec), write_tiny_reward_model(folder / "reward_model", spec)


def write_adapter(policy: Path, folder: Path) -> Path:
    """A LoRA adapter of ``policy`` as PEFT saves one (adapter_config.json + adapter_model.safetensors)."""
    from peft import LoraConfig, get_peft_model

    from hybridflow.models.loading import load_causal_lm

    get_peft_model(load_causal_lm(policy), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
                   ).save_pretrained(str(folder))
    return folder


def write_data(folder: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = folder / "data" / "train.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = {"data_source": ["openai/gsm8k"], "prompt": [[{"role": "user", "content": "1+1?"}]],
            "reward_model": [{"style": "rule", "ground_truth": "2"}], "extra_info": [{"index": 0}]}
    pq.write_table(pa.table(rows), path)
    return path


# ----------------------------------------------------------------------------------------------
# Explaining


def is_megatron(args: list[str]) -> bool:
    return any("megatron" in arg for arg in args)


def explain(args: list[str], cwd: Path) -> tuple[int, str, str]:
    """``hybridflow config explain ARGS`` in this process: (exit code, stdout, stderr)."""
    from hybridflow.cli import main

    out, err = io.StringIO(), io.StringIO()
    previous = os.getcwd()
    os.chdir(cwd)  # verl runs from its checkout: a config's hydra.searchpath is relative to it
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["config", "explain", *args])
            except SystemExit as exc:  # argparse
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        os.chdir(previous)
    return code, out.getvalue(), err.getvalue()


CANNOT_RUN = "cannot run here:"


def judge(script: str, args: list[str] | None, cwd: Path) -> Outcome:
    if args is None:
        return Outcome(script, "fsdp", "not-run", "the script launched no verl.trainer.main_ppo under the stub")
    kind = "megatron" if is_megatron(args) else "fsdp"
    code, out, err = explain(args, cwd)
    machine = [line.strip() for line in out.splitlines() + err.splitlines() if CANNOT_RUN in line]
    if code == 0:
        return Outcome(script, kind, "machine" if machine else "pass", machine=machine)
    # explain lists every config error on stdout ("Config errors (N)", then "  - ..." lines).
    listed = out.split("Config errors (", 1)[1].splitlines()[1:] if "Config errors (" in out else []
    errors = [line[4:] for line in listed if line.startswith("  - ")]
    lines = [line.strip() for line in err.splitlines() if line.strip() and not _log_line(line)]
    first = errors[0] if errors else (lines[-1] if lines else f"exit {code}")
    return Outcome(script, kind, "refused", first, machine, errors)


def _log_line(line: str) -> bool:
    return bool(re.match(r"^\d\d:\d\d:\d\d (INFO|WARNING|DEBUG) ", line))


# ----------------------------------------------------------------------------------------------
# Report


def report(outcomes: list[Outcome], verbose: bool, top: int) -> str:
    lines = []
    width = max((len(o.script) for o in outcomes), default=10)
    for o in outcomes:
        detail = o.error if o.status in ("refused", "not-run") else ("; ".join(o.machine) if verbose else "")
        lines.append(f"{o.status:8} {o.kind:8} {o.script:{width}}  {detail[:240] if not verbose else detail}".rstrip())
    lines.append("")
    for kind in ("fsdp", "megatron"):
        group = [o for o in outcomes if o.kind == kind]
        counts = collections.Counter(o.status for o in group)
        accepted = counts["pass"] + counts["machine"]
        share = f"{100 * accepted / len(group):.0f}%" if group else "-"
        lines.append(f"{kind:8} {len(group):3} scripts: {accepted} accepted ({share}; {counts['pass']} pass, "
                     f"{counts['machine']} machine-only), {counts['refused']} refused, {counts['not-run']} not run")
    errors = collections.Counter(_error_kind(o.error) for o in outcomes if o.status == "refused")
    if errors:
        lines += ["", f"top first errors (of {sum(errors.values())} refused):"]
        lines += [f"  {n:3}  {text}" for text, n in errors.most_common(top)]
    machine = collections.Counter(m.split(CANNOT_RUN, 1)[1].strip()[:120] for o in outcomes for m in o.machine)
    if machine:
        lines += ["", "cannot run here (machine-only problems, any script):"]
        lines += [f"  {n:3}  {text}" for text, n in machine.most_common(top)]
    return "\n".join(lines)


def _error_kind(error: str) -> str:
    """An error with its script-specific numbers and paths blurred, so like errors group together."""
    key = re.search(r"(config key|unknown config key) '([^']+)'", error)
    if key:
        return f"{key.group(1)} '{key.group(2)}' ..."
    return re.sub(r"\d+", "N", error)[:160]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verl", default=None, help="a verl work tree or git directory (default: the mirror)")
    parser.add_argument("--rev", default="HEAD", help="the revision of a git directory (default HEAD)")
    parser.add_argument("-k", dest="pattern", default=None, help="only scripts whose path contains this")
    parser.add_argument("-v", "--verbose", action="store_true", help="full errors and machine-only lines")
    parser.add_argument("--top", type=int, default=15, help="most frequent first errors to list")
    parser.add_argument("--json", default=None, help="also write the outcomes to this file")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger().addHandler(logging.NullHandler())  # the CLI's basicConfig then stays quiet
    with tempfile.TemporaryDirectory(prefix="verl-examples-") as tmp:
        scratch = Path(tmp)
        root = checkout(args.verl, args.rev, scratch)
        home = scratch / "home"
        home.mkdir()
        bin_dir = stub_bin(scratch)
        policy, reward_model = write_models(scratch / "models")
        local = LocalFiles(policy, reward_model, write_data(home), write_adapter(policy, scratch / "adapter"))
        outcomes = []
        for script in example_scripts(root, args.pattern):
            calls = expand(script, root, bin_dir, home)
            hydra_args = trainer_args(calls)
            localized = None if hydra_args is None else localize(hydra_args, local)
            outcomes.append(judge(str(script.relative_to(root)), localized, root))
    print(report(outcomes, args.verbose, args.top))
    if args.json:
        Path(args.json).write_text(json.dumps([o.__dict__ for o in outcomes], indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
