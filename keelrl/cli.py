"""The `keel` command line: `keel algos | config | train | eval | report | view | lab | tasks | model | precision |
audit`."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import threading
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

from rich.console import Console
from rich.table import Table

from keelrl import __version__
from keelrl.errors import ConfigError


def _cmd_algos(args: argparse.Namespace) -> int:
    from keelrl.algos import ALL, PRESETS, comparison_table
    from keelrl.algos.catalogue import symbolic_summary

    if args.format == "markdown":
        from keelrl.algos.catalogue import comparison_markdown

        print(comparison_markdown(), end="")
        return 0
    rows = comparison_table()
    if args.preset:
        if args.preset not in PRESETS:
            raise ConfigError("preset", f"unknown preset {args.preset!r}; valid names: {', '.join(PRESETS)}")
        rows = [row for row in rows if row["preset"] == args.preset]
    if args.format == "json":
        summaries = {kind: {entry.name: symbolic_summary(entry.summary) for entry in registry.entries()}
                     for kind, registry in ALL.items()}
        payload = {"presets": rows, "components": summaries}
        print(json.dumps(payload, indent=2))
        return 0
    console = Console(width=max(Console().width, 160) if args.format == "table" else 200)
    table = Table(title="keelrl presets: how each algorithm assigns credit, weights tokens and limits updates",
                  show_lines=True)
    for column in ("preset", "credit assignment", "token weighting", "update limit", "KL to reference",
                   "dynamic sampling"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(row["preset"], row["credit"], row["token_weighting"], row["update_limit"], row["kl"],
                      "yes" if row["dynamic_sampling"] else "no")
    console.print(table)
    if args.components:
        for kind, registry in ALL.items():
            components = Table(title=f"{kind} ({registry.kind})")
            components.add_column("name")
            components.add_column("summary")
            for entry in registry.entries():
                components.add_row(entry.name, symbolic_summary(entry.summary))
            console.print(components)
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from keelrl.components import check, explain
    from keelrl.config import dump_config, load_config
    from keelrl.envs.registry import settle_env

    if args.explain:
        table = Table(title="configuration fields (set in YAML or as dotted.key=value)")
        for column in ("field", "default", "help"):
            table.add_column(column, overflow="fold")
        for row in explain():
            table.add_row(*row)
        Console(width=160).print(table)
        return 0
    cfg = load_config(args.config, args.overrides)
    spec = check(cfg)  # an unregistered component (env.name, rollout.engine, ...) fails here, listing the registered ones
    sys.stdout.write(dump_config(settle_env(cfg, spec)))  # env.max_turns as the run will have it
    return 0


def _load_task_source(source: str, split: str, seed: int) -> list:
    from keelrl.envs.task_sources import source_split

    return source_split(source, split, seed)


def _cmd_tasks(args: argparse.Namespace) -> int:
    from keelrl.envs.tasks import TaskError, save_tasks

    try:
        tasks = _load_task_source(args.source, args.split, args.seed)
    except (TaskError, OSError) as error:
        print(f"keel: {error}", file=sys.stderr)
        return 2
    if args.action == "export":
        if args.out:
            count = save_tasks(tasks, args.out)
            print(f"wrote {count} tasks to {args.out}", file=sys.stderr)
        else:
            for task in tasks:
                sys.stdout.write(task.to_json() + "\n")
        return 0
    from rich.progress import Progress

    from keelrl.sandbox import isolation_report
    from keelrl.envs.verifiers import check_tasks

    print(f"{len(tasks)} tasks: schema valid; checking behaviour in the sandbox "
          f"({', '.join(isolation_report().mechanisms())})", file=sys.stderr)
    with Progress(transient=True, console=Console(stderr=True)) as progress:
        bar = progress.add_task("validating", total=len(tasks))
        problems = check_tasks(tasks, workers=args.workers,
                               progress=lambda done: progress.update(bar, completed=done))
    for line in problems:
        print(line)
    print(f"{len(tasks)} tasks, {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


def _cmd_train(args: argparse.Namespace) -> int:
    from keelrl.config import load_config
    from keelrl.runs import CheckpointError
    from keelrl.train.console import ConsoleProgress
    from keelrl.train.trainer import Trainer

    if args.resume:
        run_config = Path(args.resume) / "config.yaml"
        if not run_config.exists():
            print(f"keel: nothing to resume in {args.resume!r} (no config.yaml)", file=sys.stderr)
            return 2
        cfg = load_config(run_config, args.overrides)
    else:
        cfg = load_config(args.config, args.overrides)
    console = Console(stderr=True)
    report = ConsoleProgress(cfg.train.steps, console)
    trainer = Trainer(cfg, progress=report)  # a bad config fails here, before the bar is drawn
    with report:
        try:
            summary = trainer.run(resume=bool(args.resume))
        except CheckpointError as error:
            report.__exit__(None, None, None)
            print(f"keel: cannot resume: {error}", file=sys.stderr)
            return 2
    console.print_json(data=summary)
    return 0


def _checkpoint_config(run_dir: Path, overrides: list[str]) -> Any:
    """The config of the run in `run_dir` with model.path at its last checkpoint's model (then
    `overrides`); None, having said why on stderr, when it has no readable checkpoint."""
    from keelrl.config import load_config
    from keelrl.runs import CheckpointError, latest_checkpoint

    try:
        checkpoint = latest_checkpoint(run_dir)
    except CheckpointError as error:
        print(f"keel: {error}", file=sys.stderr)
        return None
    if checkpoint is None:
        print(f"keel: no checkpoint in {str(run_dir)!r} (no checkpoint.json)", file=sys.stderr)
        return None
    return load_config(run_dir / "config.yaml", [f"model.path={checkpoint / 'model'}", *overrides])


def _cmd_eval(args: argparse.Namespace) -> int:
    from keelrl.train.trainer import Trainer

    # Evaluation logs to no sink: a run's W&B or MLflow need not be installed to evaluate it.
    cfg = _checkpoint_config(Path(args.run_dir), ["log.sinks=[jsonl]", *args.overrides])
    if cfg is None:
        return 2
    result = Trainer(cfg).evaluate()
    print(json.dumps(result, indent=2))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from keelrl.metrics import plot_run
    from keelrl.runs import read_metrics

    rows = read_metrics(args.run_dir)
    if not rows:
        print(f"keel: no metrics.jsonl in {args.run_dir!r}", file=sys.stderr)
        return 2
    table = Table(title=f"run {args.run_dir}")
    for column in ("step", "train/reward", "eval/success", "policy/entropy", "policy/clip_frac", "time/step_s"):
        table.add_column(column)
    for row in rows:
        table.add_row(*(f"{row[c]:.3g}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in
                        ("step", "train/reward", "eval/success", "policy/entropy", "policy/clip_frac", "time/step_s")))
    Console(width=140).print(table)
    for path in plot_run(args.run_dir):
        print(path)
    return 0


def _cmd_view(args: argparse.Namespace) -> int:
    from keelrl.viewer import ViewError, serve, write_report

    try:
        page = write_report(args.run_dir, args.out)
    except ViewError as error:
        print(f"keel: {error}", file=sys.stderr)
        return 2
    print(page)
    if args.serve:
        server, url = serve(page, port=args.port)
        print(f"serving {page} at {url} (Ctrl-C stops)", file=sys.stderr)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
        finally:
            server.shutdown()
    return 0


def _cmd_lab(args: argparse.Namespace) -> int:
    from keelrl.labs import LABS, run_lab

    if args.name is None or args.name == "list":
        for name, (description, _, _) in LABS.items():
            print(f"{name:18} {description}")
        return 0
    if args.name not in LABS:
        print(f"keel: unknown lab {args.name!r}; valid names: {', '.join(LABS)}", file=sys.stderr)
        return 2
    if args.seeds < 1:
        print(f"keel: --seeds must be >= 1, got {args.seeds}", file=sys.stderr)
        return 2
    console = Console(stderr=True)
    result = run_lab(args.name, args.out, args.overrides, quick=args.quick, seeds=args.seeds,
                     keep_checkpoints=args.keep_checkpoints, rl_overrides=args.rl,
                     progress=lambda message: console.print(f"[lab {args.name}] {message}", highlight=False))
    print(result.summary)
    for path in result.files:
        print(path)
    return 0


_ANSWER_AUDIT_FLAGS = ("dataset", "rg_size", "rg_seed")
"""`keel audit` flags for the env.* config fields of the same names (reasoning_gym's)."""
_CODING_AUDIT_FLAGS = (("--tasks", "tasks", "bundled"), ("--workers", "workers", None), ("--verifier", "verifier", "strong"))
"""`keel audit` flags of the coding audit alone: (flag, attribute, default)."""


def _cmd_audit(args: argparse.Namespace) -> int:
    """`keel audit`: the coding audit (the default), reasoning-gym's answer audit (--env reasoning_gym),
    or the generic probes of keelrl.audit.generic for any other environment (or with --generic)."""
    from keelrl.audit import AuditError, planted_secret, print_report, run_audit
    from keelrl.envs.base import VerifierError
    from keelrl.envs.tasks import TaskError
    from keelrl.sandbox import SandboxError

    for name in ("limit", "workers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            print(f"keel: --{name} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if args.generic or args.env not in ("coding", "reasoning_gym"):
        return _audit_generic(args)
    if args.env == "reasoning_gym":
        return _audit_answers(args)
    given = [f"--{name.replace('_', '-')}" for name in _ANSWER_AUDIT_FLAGS if getattr(args, name) is not None]
    if given:
        print(f"keel: {', '.join(given)} go with --env reasoning_gym", file=sys.stderr)
        return 2
    if args.overrides:
        print(f"keel: the coding audit takes --tasks and --verifier, not overrides ({' '.join(args.overrides)}); "
              f"add --generic for the generic probes on a configured coding environment", file=sys.stderr)
        return 2
    try:
        tasks = _load_task_source(args.tasks, "all", 0)
    except (TaskError, OSError) as error:
        print(f"keel: {error}", file=sys.stderr)
        return 2
    tasks = tasks[:args.limit] if args.limit is not None else tasks
    if not tasks:
        print(f"keel: no tasks in {args.tasks!r}", file=sys.stderr)
        return 2
    # The canary lives in this process's environment only while the audit runs: a sandbox that
    # passed the parent's environment on would hand it to the secret_env probe.
    return _run_audit(args, f"auditing {len(tasks)} tasks ({args.verifier})", len(tasks),
                      lambda progress: run_audit(tasks, args.verifier, workers=args.workers, progress=progress),
                      print_report, (AuditError, VerifierError, SandboxError), planted_secret())


def _audit_overrides(args: argparse.Namespace) -> list[str]:
    """env.name, the env.* fields given as flags (--dataset...), then the dotted overrides."""
    return [f"env.name={args.env}",
            *(f"env.{name}={getattr(args, name)}" for name in _ANSWER_AUDIT_FLAGS if getattr(args, name) is not None),
            *args.overrides]


def _audit_answers(args: argparse.Namespace) -> int:
    """`keel audit --env reasoning_gym`: the answer probes of keelrl.audit.reasoning_gym."""
    from keelrl.audit.reasoning_gym import print_answer_report, run_answer_audit
    from keelrl.components import check
    from keelrl.config import load_config
    from keelrl.envs.base import VerifierError
    from keelrl.envs.reasoning_gym import ReasoningGymEnvFactory, rg_tasks

    for flag, name, default in _CODING_AUDIT_FLAGS:
        if getattr(args, name) != default:
            print(f"keel: {flag} is for --env coding (reasoning_gym is scored by the dataset alone)", file=sys.stderr)
            return 2
    cfg = load_config(None, _audit_overrides(args))
    check(cfg)  # checks the dataset (and that reasoning-gym is installed)
    env = cfg.env
    tasks = rg_tasks(env.dataset, env.rg_size, env.rg_seed)
    tasks = tasks[:args.limit] if args.limit is not None else tasks
    make_env = ReasoningGymEnvFactory(env.dataset, env.rg_size, env.rg_seed, max_turns=1)
    return _run_audit(args, f"auditing {len(tasks)} tasks of {env.dataset}", len(tasks),
                      lambda progress: run_answer_audit(tasks, make_env, progress=progress),
                      print_answer_report, (VerifierError,))


def _audit_generic(args: argparse.Namespace) -> int:
    """`keel audit --env NAME [overrides]`: keelrl.audit.generic's probes on the environment NAME names
    (registered, an entry point or MODULE:ATTRIBUTE), configured as `keel train` would configure it."""
    from keelrl.audit import AuditError
    from keelrl.audit.generic import audit_tasks, print_generic_report, run_generic_audit
    from keelrl.components import check
    from keelrl.config import load_config
    from keelrl.envs.base import VerifierError
    from keelrl.envs.registry import settle_env

    for flag, name, default in _CODING_AUDIT_FLAGS:
        if getattr(args, name) != default:
            hint = "; set env.verifier=NAME to audit a training verifier" if name == "verifier" else ""
            print(f"keel: {flag} is for the coding audit (--env coding without --generic){hint}", file=sys.stderr)
            return 2
    # The audit trains nothing: an environment without a scripted teacher needs no warm_start.demos=0.
    cfg = load_config(None, ["warm_start.demos=0", *_audit_overrides(args)])
    spec = check(cfg)  # an unknown env.name fails here in one line, listing the valid names
    cfg = settle_env(cfg, spec)
    tasks = audit_tasks(cfg, spec)
    tasks = tasks[:args.limit] if args.limit is not None else tasks
    return _run_audit(args, f"auditing {len(tasks)} tasks of {spec.label}", len(tasks),
                      lambda progress: run_generic_audit(cfg, spec, tasks, progress=progress),
                      print_generic_report, (AuditError, VerifierError))


def _run_audit(args: argparse.Namespace, label: str, total: int, run: Callable[[Callable[[int], None]], Any],
               show: Callable[[Any, Console], None], errors: tuple[type[Exception], ...],
               context: ContextManager[Any] = contextlib.nullcontext()) -> int:
    """`run(progress)` under `context` with a progress bar, then its report (table or JSON): exit 1
    when the report is flagged, 2 when the audit failed with one of `errors`."""
    from rich.progress import Progress

    with context, Progress(transient=True, console=Console(stderr=True)) as progress:
        bar = progress.add_task(label, total=total)
        try:
            report = run(lambda done: progress.update(bar, completed=done))
        except errors as error:
            print(f"keel: audit failed: {error}", file=sys.stderr)
            return 2
    if args.format == "json":
        print(json.dumps(report.to_dict(), indent=2))
    else:
        show(report, Console(width=max(Console().width, 160)))
    return 1 if report.flagged else 0


def _cmd_model(args: argparse.Namespace) -> int:
    from keelrl.policy.download import ModelFetchError, fetch_model, list_models, model_cache_dir

    if args.action == "list":
        table = Table(title=f"registered models (model.path=NAME; cache: {model_cache_dir()})")
        for column in ("name", "cached", "size", "license", "description"):
            table.add_column(column, overflow="fold")
        for row in list_models():
            table.add_row(row["name"], "yes" if row["cached"] else "no", row["size"], row["license"],
                          row["description"])
        Console(width=max(Console().width, 160)).print(table)
        return 0
    if args.name is None:
        print("keel: model fetch needs a NAME (see `keel model list`)", file=sys.stderr)
        return 2
    try:
        print(fetch_model(args.name, progress=True))
    except (ModelFetchError, ValueError) as error:
        print(f"keel: {error}", file=sys.stderr)
        return 2
    return 0


def _cmd_precision(args: argparse.Namespace) -> int:
    from keelrl.policy.download import ModelFetchError
    from keelrl.policy.model import load_policy, resolve_device
    from keelrl.inference.precision import USES, measurement, resolve_dtype, table_rows

    try:
        device = resolve_device(args.device)
        model, _ = load_policy(args.model, device)
    except (ModelFetchError, ValueError) as error:
        print(f"keel: {error}", file=sys.stderr)
        return 2
    console = Console(width=max(Console().width, 120))
    if device.type == "cpu":
        record = measurement(model, device, refresh=args.refresh)
        threads = record["threads"]
        table = Table(title=f"bfloat16 against float32 on {record['key']['cpu']}, {threads['current']} torch "
                            f"threads (measured {record['measured_at']}, {record['seconds']:.1f} s)")
        for column in ("probe", "float32 s", "bfloat16 s", "bf16 speed-up"):
            table.add_column(column, no_wrap=column == "probe")
        for row in table_rows(record):
            table.add_row(*row)
        console.print(table)
        if "faster" in threads:
            console.print(f"threads: torch runs {threads['current']} of the {threads['available']} cores this process "
                          f"may use; the prefill matmul ran faster on {threads['faster']} "
                          f"({', '.join(f'{n}: {t:.4f} s' for n, t in threads['matmul_256_s'].items())})",
                          highlight=False)
        if record.get("disturbed"):
            console.print(f"measured at a load average of {record['load_before']:.1f} on {threads['available']} cores: "
                          f"other processes shared them, so the next use measures again (`keel precision --refresh` "
                          f"on a quiet machine)", highlight=False)
        console.print(f"cache: {record['path'] or 'off (KEELRL_PRECISION_CACHE=off)'}", highlight=False)
    for use in USES:
        _, why = resolve_dtype("auto", use, model, device)
        console.print(f"{use}=auto: {why}", highlight=False)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import signal

    import torch

    from keelrl.config import load_config
    from keelrl.policy.download import ModelPathError, check_model_path
    from keelrl.policy.model import load_policy
    from keelrl.inference import DecoderOptions, SamplingParams
    from keelrl.serve import Endpoint, EndpointConfig

    if args.run:
        found = _checkpoint_config(Path(args.run), list(args.overrides))
        if found is None:
            return 2
        cfg = found
    else:
        cfg = load_config(args.config, args.overrides)
    try:
        check_model_path(cfg.model.path)
    except ModelPathError as error:
        raise ConfigError("model.path", str(error)) from None
    model, tokenizer = load_policy(cfg.model.path, device="auto")
    model.eval().requires_grad_(False)
    limit = getattr(model.config, "max_position_embeddings", None) or cfg.rollout.max_context_tokens
    config = EndpointConfig(
        model_name=args.name, host=args.host, port=args.port, api_key=args.api_key or "", tool_format=args.tool_format,
        max_context_tokens=min(limit, args.max_context or limit),
        sampling=SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                max_new_tokens=args.max_tokens, stop=(), keep_kv=True),
        decoder=DecoderOptions(decoder=cfg.rollout.decoder, kv_budget_mb=cfg.rollout.kv_budget_mb, eager=cfg.rollout.eager,
                               dtype=getattr(torch, cfg.rollout.dtype) if cfg.rollout.dtype != "auto" else None),
        seed=cfg.seed)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with Endpoint(model, tokenizer, config, decode_thread=False) as endpoint:
        print(f"keel: serving {cfg.model.path} as {args.name!r} on {endpoint.url}/v1 (Ctrl-C stops)", file=sys.stderr,
              flush=True)
        try:
            endpoint.serve(until=stop.is_set)
        except KeyboardInterrupt:
            pass
        if args.record:
            with open(args.record, "w", encoding="utf-8") as handle:
                for session in endpoint.sessions.values():
                    for call in session.calls:
                        handle.write(json.dumps({"session": session.id, **call.to_dict()}) + "\n")
            print(f"keel: {sum(len(s.calls) for s in endpoint.sessions.values())} calls recorded in {args.record}",
                  file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keel", description="keelrl: RL for LLM agents.")
    parser.add_argument("--version", action="version", version=f"keelrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    algos = sub.add_parser("algos", help="print the comparison table of algorithm presets")
    algos.add_argument("--format", choices=("table", "json", "markdown"), default="table",
                       help="markdown: the table and every component, as docs/algorithms.md holds them")
    algos.add_argument("--preset", help="show only this preset")
    algos.add_argument("--components", action="store_true", help="also list every registered component")
    algos.set_defaults(func=_cmd_algos)

    config = sub.add_parser("config", help="validate a config and print it fully resolved")
    config.add_argument("config", nargs="?", help="YAML config file (default: built-in defaults)")
    config.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    config.add_argument("--explain", action="store_true", help="list every field with its help")
    config.set_defaults(func=_cmd_config)

    train = sub.add_parser("train", help="warm start, then RL; writes everything to run_dir")
    train.add_argument("config", nargs="?", help="YAML config (default: the built-in default run)")
    train.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. algo.preset=dapo")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    train.set_defaults(func=_cmd_train)

    serve = sub.add_parser("serve", help="serve the policy as an OpenAI-compatible chat-completions endpoint that "
                                         "records every call's tokens (keelrl.serve)")
    serve.add_argument("config", nargs="?", help="YAML config whose model.path is served (default: the built-in "
                                                 "default's)")
    serve.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. model.path=tiny")
    serve.add_argument("--run", metavar="RUN_DIR", help="serve a run's last checkpoint")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", dest="api_key", help="refuse requests without Authorization: Bearer KEY (401)")
    serve.add_argument("--name", default="keel-policy", help="the model id requests name")
    serve.add_argument("--tool-format", dest="tool_format", default="hermes", choices=("hermes", "json"),
                       help="how tool calls are written in completions")
    serve.add_argument("--max-tokens", dest="max_tokens", type=int, default=512,
                       help="the most tokens a completion may have")
    serve.add_argument("--max-context", dest="max_context", type=int,
                       help="prompt plus completion limit (default: the model's)")
    serve.add_argument("--record", metavar="FILE", help="on exit, write every call (session, token ids, log-probs, "
                                                        "policy version) to this JSONL file")
    serve.set_defaults(func=_cmd_serve)

    evaluate = sub.add_parser("eval", help="evaluate a run's last checkpoint on held-out tasks")
    evaluate.add_argument("run_dir")
    evaluate.add_argument("overrides", nargs="*")
    evaluate.set_defaults(func=_cmd_eval)

    report = sub.add_parser("report", help="print a run's metrics and draw its plots")
    report.add_argument("run_dir")
    report.set_defaults(func=_cmd_report)

    view = sub.add_parser("view", help="write a run's trajectory viewer: one self-contained HTML page of its "
                                       "curves and episodes, each action token shaded by its advantage")
    view.add_argument("run_dir")
    view.add_argument("--out", help="where to write the page (default RUN_DIR/view.html)")
    view.add_argument("--serve", action="store_true", help="also serve it on localhost until Ctrl-C")
    view.add_argument("--port", type=int, default=8765, help="--serve: the port (0: any free one)")
    view.set_defaults(func=_cmd_view)

    lab = sub.add_parser("lab", help="run a lab: a failure mode and its remedy, side by side (list: names)")
    lab.add_argument("name", nargs="?", help="lab name, or 'list'")
    lab.add_argument("overrides", nargs="*", help="dotted.key=value applied to every training run of the lab, "
                                                  "its warm start included (one the warm start reads makes and "
                                                  "caches a student of its own)")
    lab.add_argument("--rl", action="append", default=[], metavar="KEY=VALUE",
                     help="a dotted.key=value for the arms' RL runs alone, after the overrides: the warm start, "
                          "and so the cached student, is untouched (repeat for several)")
    lab.add_argument("--out", help="output directory (default runs/lab-NAME)")
    lab.add_argument("--quick", action="store_true", help="a tiny budget, for a smoke run")
    lab.add_argument("--seeds", type=int, default=1,
                     help="run every arm this many times (seeds seed, seed+1, ...) from the same warm-started "
                          "student; the summary gives each number's spread over seeds (default 1)")
    lab.add_argument("--keep-checkpoints", action="store_true",
                     help="keep each arm's final checkpoint (by default removed once the arm has finished: "
                          "1.6 GB an arm on SmolLM2)")
    lab.set_defaults(func=_cmd_lab)

    tasks = sub.add_parser("tasks", help="export or validate coding tasks (JSONL, one task a line)")
    tasks.add_argument("action", choices=("export", "validate"))
    tasks.add_argument("source", nargs="?", default="bundled",
                       help="bundled, agent, real (comma-separated, e.g. bundled,real), or a tasks .jsonl file")
    tasks.add_argument("--split", choices=("all", "train", "heldout"), default="all")
    tasks.add_argument("--seed", type=int, default=0, help="split seed")
    tasks.add_argument("--out", help="export: write here instead of stdout")
    tasks.add_argument("--workers", type=int, default=2, help="validate: parallel sandbox runs")
    tasks.set_defaults(func=_cmd_tasks)

    model = sub.add_parser("model", help="list the registered models, or fetch one into the cache")
    model.add_argument("action", choices=("list", "fetch"))
    model.add_argument("name", nargs="?", help="fetch: the registered model name, e.g. smollm2")
    model.set_defaults(func=_cmd_model)

    from keelrl.config import ModelConfig

    precision = sub.add_parser("precision", help="show (measuring on first use) what eval.dtype, rollout.dtype and "
                                                 "perf.learner_precision=auto choose on this machine, and why")
    precision.add_argument("--model", default=ModelConfig.path,
                           help=f"the model whose shapes are timed (model.path; default {ModelConfig.path})")
    precision.add_argument("--device", default="cpu", help="the device (CPU: measured; CUDA: bf16, not measured)")
    precision.add_argument("--refresh", action="store_true", help="measure again and replace the cached figures")
    precision.set_defaults(func=_cmd_precision)

    from keelrl.envs.verifiers import VERIFIERS

    audit = sub.add_parser("audit", help="run cheating and correct answers through an environment's verifier; "
                                         "exit 1 if a cheat scores or a correct answer is rejected, 2 if the "
                                         "audit failed")
    audit.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the environment's config "
                                                    "(not for the coding audit), e.g. env.verifier=weak")
    audit.add_argument("--env", default="coding",
                       help="coding (default): the bug-fix tasks' verifiers; reasoning_gym: a dataset's "
                            "score_answer (cheats must score below 1, correct answers 1); any other env.name "
                            "(registered, an entry point or MODULE:ATTRIBUTE): the generic probes")
    audit.add_argument("--generic", action="store_true",
                       help="run the generic probes on coding or reasoning_gym too, instead of their own audits")
    audit.add_argument("--dataset", help="--env reasoning_gym: the dataset (env.dataset)")
    audit.add_argument("--rg-size", type=int, dest="rg_size", help="--env reasoning_gym: entries generated "
                                                                   "(env.rg_size)")
    audit.add_argument("--rg-seed", type=int, dest="rg_seed", help="--env reasoning_gym: generation seed "
                                                                   "(env.rg_seed)")
    audit.add_argument("--tasks", default="bundled",
                       help="coding: bundled, agent, real (comma-separated, e.g. bundled,real), or a tasks .jsonl "
                            "file")
    audit.add_argument("--verifier", choices=list(VERIFIERS), default="strong",
                       help="coding: the verifier to audit (other environments: env.verifier=NAME)")
    audit.add_argument("--format", choices=("table", "json"), default="table")
    audit.add_argument("--limit", type=int, help="audit only the first N tasks (default: all; generic: the train "
                                                 "tasks first, then the held-out ones)")
    audit.add_argument("--workers", type=int, help="coding: parallel episodes (default: 8 per CPU core, at most 64)")
    audit.set_defaults(func=_cmd_audit)
    return parser


def _looks_like_override(argument: str) -> bool:
    """`algo.preset=dapo` is an override; `runs/lr=3e-4/config.yaml` (an existing file) is not."""
    return not Path(argument).exists() and re.match(r"^[A-Za-z_][\w.]*=", argument) is not None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may follow options too (`keel lab NAME --out DIR key=value`): argparse leaves a
    # positional list that comes after an option unparsed, so collect those here.
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if not (hasattr(args, "overrides") and _looks_like_override(a))]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if getattr(args, "config", None) and _looks_like_override(args.config):
        args.overrides = [args.config, *args.overrides]
        args.config = None
    try:
        return args.func(args)
    except ConfigError as error:
        print(f"keel: config error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
