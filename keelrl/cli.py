"""The `keel` command line: `keel algos`, `keel config` (more verbs arrive with the trainer)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.table import Table

from keelrl import __version__
from keelrl.errors import ConfigError


def _cmd_algos(args: argparse.Namespace) -> int:
    from keelrl.algos import ALL, PRESETS, comparison_table

    rows = comparison_table()
    if args.preset:
        if args.preset not in PRESETS:
            raise ConfigError("preset", f"unknown preset {args.preset!r}; valid names: {', '.join(PRESETS)}")
        rows = [row for row in rows if row["preset"] == args.preset]
    if args.format == "json":
        payload = {"presets": rows,
                   "components": {kind: {e.name: e.summary for e in registry} for kind, registry in ALL.items()}}
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
            for entry in registry:
                components.add_row(entry.name, entry.summary)
            console.print(components)
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from keelrl.config import dump_config, explain, load_config

    if args.explain:
        table = Table(title="configuration fields (set in YAML or as dotted.key=value)")
        for column in ("field", "default", "help"):
            table.add_column(column, overflow="fold")
        for row in explain():
            table.add_row(*row)
        Console(width=160).print(table)
        return 0
    cfg = load_config(args.config, args.overrides)
    sys.stdout.write(dump_config(cfg))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keel", description="keelrl: RL for LLM agents.")
    parser.add_argument("--version", action="version", version=f"keelrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    algos = sub.add_parser("algos", help="print the comparison table of algorithm presets")
    algos.add_argument("--format", choices=("table", "json"), default="table")
    algos.add_argument("--preset", help="show only this preset")
    algos.add_argument("--components", action="store_true", help="also list every registered component")
    algos.set_defaults(func=_cmd_algos)

    config = sub.add_parser("config", help="validate a config and print it fully resolved")
    config.add_argument("config", nargs="?", help="YAML config file (default: built-in defaults)")
    config.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    config.add_argument("--explain", action="store_true", help="list every field with its help")
    config.set_defaults(func=_cmd_config)
    return parser


def _looks_like_override(argument: str) -> bool:
    """`algo.preset=dapo` is an override; `runs/lr=3e-4/config.yaml` (an existing file) is not."""
    return not Path(argument).exists() and re.match(r"^[A-Za-z_][\w.]*=", argument) is not None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
