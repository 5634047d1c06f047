"""The `meridian` command: one subcommand per process kind."""

import argparse
import importlib
import logging
import sys

from meridian import __version__
from meridian.errors import UserError

# subcommand -> (module providing add_arguments(parser) and run(args) -> int, help)
COMMANDS = {
    "generate": ("meridian.worker.generate", "generate text offline (one prompt or a JSONL file)"),
    "operator": ("meridian.operator.cli", "run the Kubernetes operator for ModelDeployments"),
    "worker": ("meridian.worker.server", "serve one model replica over gRPC (meridian.v1)"),
    "gateway": ("meridian.gateway.server", "route OpenAI-compatible HTTP and gRPC to workers"),
    "serve": ("meridian.serve", "run local workers and a gateway with the bundled model"),
}


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="meridian", description="Serve LLMs across regions.")
    parser.add_argument("--version", action="version", version=f"meridian {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    modules = {}
    wanted = sys.argv[1:]
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # Import a subcommand's module only when it runs or its help is asked for: the worker
        # pulls in torch, which the operator and gateway never need.
        if name in wanted:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            modules[name] = module
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv[1:] = argv
    parser, modules = build_parser()
    args = parser.parse_args()
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return modules[args.command].run(args) or 0
    except UserError as e:
        print(f"meridian {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
