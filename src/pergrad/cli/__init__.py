"""``pergrad`` on the command line: ``analyze`` (the main job), ``bench`` and ``privacy``.

Thin: argument parsing and printing; the work is done by the library.
"""

from __future__ import annotations

import argparse
import os
import sys


class _Parser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr, exit code 2 (argparse prints the usage too)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from pergrad.cli import analyze, bench, privacy

    parser = _Parser(prog="pergrad", description="Fast per-example gradients for Keras 3.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    analyze.add_parser(commands)
    bench.add_parser(commands)
    privacy.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from pergrad.cli import analyze, bench, privacy

    run = {"analyze": analyze.run, "bench": bench.run, "privacy": privacy.run}[args.command]
    try:
        return int(run(args) or 0)
    except ModuleNotFoundError as error:
        if error.name not in BACKEND_EXTRAS:
            raise
        # Keras imports its backend when first imported: without one installed (a bare
        # `pip install pergrad`) that import fails far from the cause.
        backend = os.environ.get("KERAS_BACKEND") or "tensorflow (Keras's default)"
        sys.stderr.write(
            f"pergrad: error: {error.name} is not installed (the Keras backend here is "
            f"{backend}): pip install 'pergrad[{error.name}]', or set KERAS_BACKEND to an "
            "installed backend\n")
        return 2


#: The backends, each installed by the pergrad extra of its name.
BACKEND_EXTRAS = ("tensorflow", "jax", "torch")


if __name__ == "__main__":
    sys.exit(main())
