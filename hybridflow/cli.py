"""``hybridflow`` command line: a thin layer over the Python API.

    hybridflow train [--preset grpo] [--config my.yaml] [--config-path DIR --config-name NAME] [key=value ...]
    hybridflow sft [--config my.yaml] data.train_files=... [key=value ...]   (supervised fine-tuning)
    hybridflow dpo [--config my.yaml] [data.train_files=...] [key=value ...]   (preference pairs; none: built-in)
    hybridflow rm [--preset builtin] [--config my.yaml] [data.train_files=...] [key=value ...]   (a reward model on
                                                 preference pairs; its presets are its own: presets/rm/)
    hybridflow config explain [same as train]   (every config error at once, exit 2; what this machine
                                                 lacks as "cannot run here" lines, exit 0)
    hybridflow config presets
    hybridflow plan [--preset ...] [--config ...] [key=value ...]   (predicted peak memory per role and phase)
    hybridflow export <checkpoint or run folder> <out dir> [--overwrite] [--endpoint-url URL]   (either may be s3://...)
    hybridflow serve <model dir | builtin:tiny | builtin:tiny-teacher> [--host 127.0.0.1] [--port 8000] [--dtype float32] [--max-n 128]
    hybridflow timeline <run folder>
    hybridflow dashboard [<runs folder>] [--host 127.0.0.1] [--port 8765]   (the live run page)
    hybridflow simulate [<run folder>] [--devices 8,64,128] [--staleness 1,2] [cost and length flags]
"""

from __future__ import annotations

if __name__ == "__main__":  # python -m hybridflow.cli: the allocator is chosen before the imports below allocate
    from hybridflow.utils.allocator import choose_allocator

    choose_allocator()

import argparse
import errno
import logging
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

from hybridflow.config import ConfigError, explain_config, list_presets, load_config, validate_config
from hybridflow.controller.checkpoint import CheckpointError


OWN_PRESETS = ("rm",)  # the commands whose --preset names presets of their own (list_presets(command))


def _add_config_args(p: argparse.ArgumentParser, *, presets: bool = True, command: str | None = None) -> None:
    """The config flags; ``presets=False`` for a command the RL presets mean nothing to (sft); ``command``:
    a command with presets of its own (``list_presets(command)``), which ``--preset`` then names."""
    _add_debug(p)
    if command is not None:
        p.add_argument("--preset", default=None,
                       help=f"starting preset of hybridflow {command}: {', '.join(list_presets(command))} "
                            f"(default: none, the settings' defaults)")
    elif presets:
        p.add_argument("--preset", default=None,
                       help=f"starting preset: {', '.join(list_presets())} (default: grpo's settings, or verl's "
                            f"algorithm.adv_estimator=gae on a command line in verl's keys)")
    else:
        p.set_defaults(preset=None)
    p.add_argument("--config", dest="config_file", default=None, help="a YAML file of overrides")
    # Hydra's flags, as verl's scripts give them (--config-path=DIR or --config-path DIR).
    p.add_argument("--config-path", dest="config_path", default=None,
                   help="Hydra: the folder of --config-name (e.g. a verl checkout's verl/trainer/config)")
    p.add_argument("--config-name", dest="config_name", default=None,
                   help="Hydra: a YAML config in --config-path, composed with its defaults list (e.g. ppo_trainer)")
    p.add_argument("overrides", nargs="*",
                   help="overrides in Hydra's grammar, e.g. rollout.n=8 actor.optim.lr=1e-5 +key=value ~key")


def _add_debug(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: a subcommand's default must not overwrite `hybridflow --debug train`'s value.
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridflow", description="RL post-training for LLMs")
    parser.add_argument("--debug", action="store_true", help=f"show tracebacks (or set {DEBUG_ENV}=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run RL training (no arguments: the built-in tiny model and task)")
    _add_config_args(train)
    sft = sub.add_parser("sft", help="supervised fine-tuning on chat data (loss on assistant tokens only)")
    _add_config_args(sft, presets=False)  # the RL presets (grpo, ppo, ...) set nothing SFT reads
    dpo = sub.add_parser("dpo", help="direct preference optimisation on (prompt, chosen, rejected) pairs")
    _add_config_args(dpo, presets=False)
    rm = sub.add_parser("rm", help="train a reward model (Bradley-Terry) on (prompt, chosen, rejected) pairs")
    _add_config_args(rm, command="rm")  # its own presets: the RL ones set nothing it reads
    config = sub.add_parser("config", help="inspect configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    explain = config_sub.add_parser("explain", help="print the resolved config and the derived plan")
    _add_config_args(explain)
    config_sub.add_parser("presets", help="list the shipped presets")
    plan = sub.add_parser(
        "plan", help="predict each role's peak device memory per phase (set trainer.device_memory_gb to check fit)"
    )
    _add_config_args(plan)
    export = sub.add_parser("export", help="write a checkpoint's policy as a Hugging Face model directory")
    export.add_argument("checkpoint", help="a checkpoint folder (global_step_N), or a run folder: its newest checkpoint")
    export.add_argument("out_dir", help="the folder to write (config, tokenizer, safetensors)")
    export.add_argument("--overwrite", action="store_true", help="replace out_dir if it exists")
    export.add_argument("--endpoint-url", default=None,
                        help="S3-compatible server for s3:// paths (as storage.endpoint_url; default: AWS, or AWS_ENDPOINT_URL)")
    _add_debug(export)
    _add_serve_parser(sub)
    timeline = sub.add_parser("timeline", help="summarize a run's timeline.json: busy and idle time per track")
    timeline.add_argument("run", help="a run folder (or its timeline.json)")
    _add_debug(timeline)
    _add_simulate_parser(sub)
    dashboard = sub.add_parser(
        "dashboard", help="serve a local web page of the runs in a folder: live curves and rollouts"
    )
    dashboard.add_argument("runs", nargs="?", default="runs", help="a folder of run folders, or one run (default runs)")
    dashboard.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; no authentication!)"
    )
    dashboard.add_argument("--port", type=int, default=8765, help="port to listen on (default 8765; 0: a free one)")
    _add_debug(dashboard)
    profile = sub.add_parser("profile-summary", help="the top operators and per-phase split of a run's profiled steps")
    profile.add_argument("run", help="a run folder (its profile/ traces), or one profile/step_<k> folder")
    profile.add_argument("--top", type=int, default=15, help="operators to list (default 15)")
    _add_debug(profile)
    return parser


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}")
    return values


def _add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser(
        "simulate", help="predict the step time of sync, one_step_off and fully_async loops (hybridflow.tracking.simulate)"
    )
    sim.add_argument("run", nargs="?", default=None, help="a run folder to take costs and lengths from (else the flags)")
    sim.add_argument("--devices", type=_int_list, default=[8, 64, 128], help="device counts (default 8,64,128)")
    sim.add_argument("--staleness", type=_int_list, default=[1, 2], help="fully_async staleness bounds (default 1,2)")
    sim.add_argument("--rollout-fraction", type=float, default=None,
                     help="share of devices generating in the split loops (default: the best split)")
    sim.add_argument("--steps", type=_positive_int, default=20, help="simulated steps after warm-up (default 20)")
    sim.add_argument("--seed", type=int, default=0, help="seed of the sampled lengths")
    g = sim.add_argument_group("from a run folder")
    g.add_argument("--replicas", type=_positive_int, default=None,
                   help="rollout replicas of the measured run (default: from its config.yaml, else 1)")
    g.add_argument("--trainer-devices", type=_positive_int, default=None,
                   help="actor ranks of the measured run (default: from its config.yaml, else 1)")
    c = sim.add_argument_group("costs (override what a run folder gave)")
    c.add_argument("--slots", type=_positive_int, default=None, help="sequences a replica decodes together (64)")
    c.add_argument("--decode-ms-per-token", type=float, default=None, help="one decode iteration of a replica (30)")
    c.add_argument("--gen-tokens-per-s", type=float, default=None,
                   help="a full replica's decode throughput; sets decode time = slots / this")
    c.add_argument("--overhead-s", type=float, default=None, help="per-sample prefill and scheduling seconds (0)")
    c.add_argument("--tp", type=_positive_int, default=None, help="devices per rollout replica (1)")
    c.add_argument("--train-s-per-token", type=float, default=None, help="trainer seconds per batch token, 1 device (1e-4)")
    c.add_argument("--reward-s", type=float, default=None, help="seconds scoring a batch (0)")
    c.add_argument("--weight-sync-s", type=float, default=None, help="seconds per weight sync (1)")
    c.add_argument("--prompt-tokens", type=float, default=None, help="mean prompt tokens (200)")
    c.add_argument("--batch", type=_positive_int, default=None, help="samples per step (512)")
    c.add_argument("--length-mean", type=float, default=None, help="lognormal response lengths: the mean (~690)")
    c.add_argument("--length-sigma", type=float, default=None, help="lognormal sigma of log-length (0.8)")
    c.add_argument("--length-cap", type=_positive_int, default=None, help="longest response (4096)")
    c.add_argument("--lengths", default=None, help="a file of response lengths (whitespace or comma separated): sampled")
    _add_debug(sim)


def _measured_shape(run: Path) -> dict[str, int]:
    """Replicas, actor ranks, engine slots and tensor parallelism of the run that made ``run``,
    from its config.yaml; empty when it has none that loads (the flags' defaults apply)."""
    from hybridflow.config.layout import data_parallel_size, rollout_replicas

    if not (run / "config.yaml").is_file():
        return {}
    try:
        cfg = load_config("grpo", str(run / "config.yaml"), [])
    except ConfigError:
        return {}
    return {"replicas": rollout_replicas(cfg), "trainer_devices": data_parallel_size(cfg.trainer),
            "slots": cfg.rollout.max_batch_size, "tp": cfg.rollout.tensor_model_parallel_size}


def _simulate(args: argparse.Namespace) -> int:
    import dataclasses
    import math

    from hybridflow.tracking import simulate as sim

    if args.run is not None:
        shape = _measured_shape(Path(args.run))
        replicas = args.replicas or shape.get("replicas", 1)
        profile = sim.profile_from_run(args.run, replicas=replicas,
                                       trainer_devices=args.trainer_devices or shape.get("trainer_devices", 1),
                                       slots=args.slots or shape.get("slots", sim.Costs().slots),
                                       overhead_s=args.overhead_s or 0.0, seed=args.seed)
        costs, lengths = profile.costs, profile.lengths
        if args.tp is None and "tp" in shape:
            costs = dataclasses.replace(costs, devices_per_replica=shape["tp"])
        print("\n".join(profile.notes) + "\n")
    else:
        costs, lengths = sim.Costs(), sim.LengthModel()
    given = {"slots": args.slots, "request_overhead_s": args.overhead_s, "devices_per_replica": args.tp,
             "train_s_per_token": args.train_s_per_token, "reward_s": args.reward_s,
             "weight_sync_s": args.weight_sync_s, "prompt_tokens": args.prompt_tokens, "batch": args.batch}
    if args.decode_ms_per_token is not None:
        given["decode_s_per_token"] = args.decode_ms_per_token / 1e3
    costs = dataclasses.replace(costs, **{k: v for k, v in given.items() if v is not None})
    if args.gen_tokens_per_s is not None:
        costs = dataclasses.replace(costs, decode_s_per_token=costs.slots / args.gen_tokens_per_s)
    if args.lengths is not None:
        text = Path(args.lengths).read_text(encoding="utf-8").replace(",", " ")
        lengths = sim.LengthModel(empirical=tuple(int(float(x)) for x in text.split()))
    elif args.length_mean is not None or args.length_sigma is not None or args.length_cap is not None:
        sigma = lengths.sigma if args.length_sigma is None else args.length_sigma
        mean = math.exp(lengths.mu + lengths.sigma ** 2 / 2) if args.length_mean is None else args.length_mean
        lengths = sim.LengthModel(mu=math.log(mean) - sigma ** 2 / 2, sigma=sigma,
                                  cap=args.length_cap or lengths.cap)
    predictions = sim.predict(args.devices, args.staleness, lengths, costs, steps=args.steps, seed=args.seed,
                              rollout_fraction=args.rollout_fraction)
    print(sim.format_predictions(predictions))
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _host_list(text: str) -> list[str]:
    return [host.strip() for host in text.split(",") if host.strip()]


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (docs/serving.md)")
    serve.add_argument("model_dir", help="a local Hugging Face model directory, builtin:tiny, or builtin:tiny-teacher "
                                         "(distillation's built-in teacher)")
    serve.add_argument(
        "overrides", nargs="*",
        help="builtin:* only: config overrides for the built-in model, e.g. warm_start.enable=false",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; no authentication!)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: a free one)")
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype")
    serve.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    serve.add_argument("--max-batch-size", type=int, default=256, help="most sequences decoded together")
    serve.add_argument(
        "--max-model-len", type=int, default=None, help="prompt + response cap (default: max_position_embeddings)"
    )
    serve.add_argument("--seed", type=int, default=0, help="engine seed, used by requests that carry none")
    serve.add_argument("--served-model-name", default=None, help="the model id clients send (default: model_dir)")
    serve.add_argument(
        "--max-n", type=_positive_int, default=None, help="most samples one request may ask for, n x prompts (128)"
    )
    serve.add_argument("--max-logprobs", type=_positive_int, default=None, help="largest logprobs/top_logprobs (20)")
    serve.add_argument(
        "--max-request-bytes", type=_positive_int, default=None,
        help="largest request body (default: 32 bytes per context token, at least 1 MiB)",
    )
    serve.add_argument(
        "--allowed-hosts", type=_host_list, action="extend", default=[],
        help="comma-separated Host names to answer besides localhost/127.0.0.1/[::1] ('*': any)",
    )


def _serve_model_dir(args: argparse.Namespace, device: str) -> str:
    """``args.model_dir``, with builtin:tiny (and builtin:tiny-teacher, distillation's built-in teacher) resolved to
    its directory as ``hybridflow train`` does."""
    import torch

    from hybridflow.config.explain import BUILTIN_TINY
    from hybridflow.config.sections.distillation import BUILTIN_TEACHER
    from hybridflow.serving.launch import ServeError

    if args.model_dir == BUILTIN_TEACHER:  # a distillation run's teacher behind a server, as train builds it
        from hybridflow.controller.builtin import resolve_teacher_path

        return resolve_teacher_path(load_config("grpo", None, args.overrides), BUILTIN_TEACHER, torch.device(device))
    if args.model_dir != BUILTIN_TINY:
        if args.overrides:
            raise ServeError(
                f"config overrides ({' '.join(args.overrides)}) apply to builtin:tiny only (and builtin:tiny-teacher); "
                f"serving {args.model_dir!r}, remove them"
            )
        return args.model_dir
    from hybridflow.controller.builtin import resolve_builtin

    # The same model `hybridflow train` starts from with these overrides (warm-started unless
    # warm_start.enable=false; cached in warm_start.cache_dir after the first time).
    cfg = load_config("grpo", None, args.overrides)
    model_dir, _, _ = resolve_builtin(cfg, torch.device(device))
    return model_dir


def _serve(args: argparse.Namespace) -> int:
    import torch

    # FastAPI, uvicorn: only when serving
    from hybridflow.serving.launch import ServeError, serve
    from hybridflow.serving.schema import ServerLimits

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    defaults = ServerLimits()
    limits = ServerLimits(
        max_n=args.max_n or defaults.max_n,
        max_logprobs=args.max_logprobs or defaults.max_logprobs,
        max_request_bytes=args.max_request_bytes,
    )
    try:
        serve(
            _serve_model_dir(args, device),
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name or args.model_dir,
            limits=limits,
            allowed_hosts=args.allowed_hosts,
            dtype=args.dtype,
            device=device,
            max_batch_size=args.max_batch_size,
            max_model_len=args.max_model_len,
            seed=args.seed,
        )
    except ServeError as exc:
        print(f"serve error: {exc}", file=sys.stderr)
        return 1
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from hybridflow.tracking.dashboard import make_dashboard_server

    server = make_dashboard_server(args.runs, host=args.host, port=args.port)

    def stop(*_: object) -> None:
        # Ctrl-C (or SIGTERM) is the user's way to stop it, not a failure. Not a KeyboardInterrupt
        # raised wherever serve_forever happens to be: shutdown() asks its loop to end after the
        # request in hand (it must be called from another thread than the loop's).
        threading.Thread(target=server.shutdown, name="dashboard-stop", daemon=True).start()

    previous = {number: signal.signal(number, stop) for number in (signal.SIGINT, signal.SIGTERM)}
    # The URL on its own line, flushed: with --port 0 it is the only way to learn the port.
    print(f"live run page of {server.runs.root}: {server.url}  (Ctrl-C stops it)", flush=True)
    try:
        server.serve_forever()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        server.server_close()
    return 0


DEBUG_ENV = "HYBRIDFLOW_DEBUG"
"""Set to 1 (like ``--debug``) to see the traceback behind an error instead of its one line."""


def _one_line(text: object) -> str:
    """``text`` on one line; a listed error (``N config errors:\n  - a\n  - b``) reads ``...: a; b``."""
    text = str(text).replace(":\n  - ", ": ").replace("\n  - ", "; ")
    return " ".join(text.split())


def describe_error(error: BaseException) -> tuple[str, int]:
    """The one line a user sees for ``error`` (what, where, the fix) and the exit code: 2 for a
    mistake in the config or the data (fix the input, run again), 1 for a failure while running."""
    # An error's class is in a module that was imported to raise it: looked up, not imported, so a
    # config error is reported before torch loads (worker_group and dataset import it).
    WorkerError = _loaded_class("hybridflow.cluster.worker_group", "WorkerError")
    DataError = _loaded_class("hybridflow.data.dataset", "DataError")
    StorageError = _loaded_class("hybridflow.utils.storage", "StorageError")

    if isinstance(error, ConfigError):
        return f"config error: {_one_line(error)}", 2
    if isinstance(error, DataError):
        return f"data error: {_one_line(error)}", 2
    if isinstance(error, CheckpointError):
        return f"checkpoint error: {_one_line(error)}", 1
    if isinstance(error, StorageError):
        return f"storage error: {_one_line(error)}", 1
    cause = _disk_full_cause(error)
    if cause is not None:
        where = f" on {cause.filename}" if cause.filename else ""
        return f"error: no space left{where}; free some disk space or point trainer.output_dir elsewhere", 1
    if isinstance(error, WorkerError):
        return f"worker error: {_one_line(error)}", 1
    if isinstance(error, OSError) and error.filename is not None:
        return f"error: {error.strerror or type(error).__name__}: {error.filename}", 1
    return f"error: {type(error).__name__}: {_one_line(error)}", 1


class _NeverRaised(Exception):
    """Stands in for an error class whose module was never imported (so nothing raised one)."""


def _loaded_class(module: str, name: str) -> type[BaseException]:
    return getattr(sys.modules.get(module), name, _NeverRaised)


def _disk_full_cause(error: BaseException) -> OSError | None:
    """The ENOSPC behind ``error``, following its causes (torch wraps it in a RuntimeError)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return current
        current = current.__cause__ or current.__context__
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with flags and overrides in any order: verl's scripts put ``--config-path``
    after some overrides, which argparse alone would refuse as unrecognized."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    flags = [arg for arg in extra if arg.startswith("-")]
    if flags or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(flags or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        return _run(args)
    except KeyboardInterrupt as exc:
        # Never exit 0 short of the planned steps: the shell's code for the signal (TrainingInterrupted's
        # exit_code: 143 for SIGTERM), 130 for SIGINT.
        print(f"stopped: {exc}" if str(exc) else "stopped by Ctrl-C", file=sys.stderr)
        return getattr(exc, "exit_code", 130)
    except Exception as exc:
        if debug:
            traceback.print_exc()
        message, code = describe_error(exc)
        hint = "" if debug else f" (--debug or {DEBUG_ENV}=1 shows the traceback)"
        print(message + (hint if code == 1 else ""), file=sys.stderr)
        return code


CANNOT_RUN = "cannot run here:"
"""How ``config explain`` lists a machine problem (the config is fine; this machine lacks something)."""


def _explain(args: argparse.Namespace) -> int:
    """``hybridflow config explain``: judge the config, not this machine. Every config error at
    once (exit 2); machine problems listed as "cannot run here" with the explanation (exit 0)."""
    from hybridflow.config.errors import ConfigErrors, flatten
    from hybridflow.config.loader import load_config_collecting
    from hybridflow.controller.preflight import machine_problems, needs_critic, resolve_plugins

    cfg, errors = load_config_collecting(args.preset, args.config_file, args.overrides, config_path=args.config_path,
                                         config_name=args.config_name)
    plugins = None
    try:
        validate_config(cfg)  # every config error first, then the pluggable names
        plugins = resolve_plugins(cfg, check_machine=False)  # a wrong pluggable name fails here, not only in train
    except ConfigError as error:
        errors.append(error)
    machine = machine_problems(cfg)
    errors = flatten(errors)
    if errors:
        # The list on stdout, one problem a line; stderr keeps its one line (all of them, "; "-joined).
        print(f"Config errors ({len(errors)})")
        print("\n".join(f"  - {_one_line(error)}" for error in errors))
        if machine:
            print("This machine")
            print("\n".join(f"  {CANNOT_RUN} {_one_line(problem)}" for problem in machine))
        print(describe_error(errors[0] if len(errors) == 1 else ConfigErrors(errors))[0], file=sys.stderr)
        return 2
    assert plugins is not None
    print(explain_config(cfg, with_critic=needs_critic(plugins.estimator_needs)), end="")
    if machine:
        print("\nThis machine")
        print("\n".join(f"  {CANNOT_RUN} {_one_line(problem)}" for problem in machine))
        print("  (the config is valid: hybridflow train runs it where these are met)")
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return _serve(args)
    if args.command == "timeline":
        from hybridflow.tracking.timeline import format_timeline_summary, read_timeline, summarize_timeline

        print(format_timeline_summary(summarize_timeline(read_timeline(args.run))))
        return 0
    if args.command == "simulate":
        return _simulate(args)
    if args.command == "dashboard":
        return _dashboard(args)
    if args.command == "profile-summary":
        from hybridflow.tracking.profiler import format_profile_summary, summarize_profile

        print(format_profile_summary(summarize_profile(args.run, top=args.top)))
        return 0
    if args.command == "export":
        from hybridflow.controller.export import export_checkpoint
        from hybridflow.utils.storage import Storage

        print(export_checkpoint(args.checkpoint, args.out_dir, overwrite=args.overwrite,
                                storage=Storage(endpoint_url=args.endpoint_url)))
        return 0
    if args.command == "config" and args.config_command == "presets":
        print("\n".join(list_presets()))
        return 0
    if args.command == "config":
        return _explain(args)
    cfg = load_config(args.preset, args.config_file, args.overrides, config_path=args.config_path,
                      config_name=args.config_name, command=args.command if args.command in OWN_PRESETS else None)
    if args.command == "plan":
        from hybridflow.config.plan_report import memory_plan_lines
        from hybridflow.controller.preflight import config_needs_critic

        validate_config(cfg)
        # Only the estimator is resolved (does it need a critic?): a GPU run is planned on any machine.
        print("\n".join(memory_plan_lines(cfg, with_critic=config_needs_critic(cfg))))
        return 0
    if args.command == "sft":
        from hybridflow.controller.sft_run import sft_cli  # heavy imports only when training

        sft_cli(cfg)
        return 0
    if args.command == "dpo":
        from hybridflow.controller.dpo_run import dpo_cli  # heavy imports only when training

        dpo_cli(cfg)
        return 0
    if args.command == "rm":
        from hybridflow.controller.rm_run import rm_cli  # heavy imports only when training

        rm_cli(cfg)
        return 0
    from hybridflow.api import train  # heavy imports (torch, transformers) only when training

    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
