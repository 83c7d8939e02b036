"""``pergrad bench``: the benchmarks of every capability, ratios against same-run baselines."""

from __future__ import annotations

import argparse
import json
import sys


def _csv(kind):
    def parse(text: str):
        try:
            values = tuple(kind(part) for part in text.split(",") if part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError("the list is empty") from None
        return values
    return parse


SUITES = ("engine", "training", "monitor", "jacobian", "label-errors")
MODEL_SUITES = ("training", "monitor")  # besides the engine, the suites --models applies to


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "bench", help="time pergrad against the batch gradient, loops, tape.jacobian and vmap; "
                      "measure label-error detection",
        description="Median times and ratios to baselines measured in the same run. Timings "
                    "depend on the machine; nothing here is a pass/fail check. The label-errors "
                    "suite reports ROC AUC / precision@k of every label-error score on "
                    "synthetic noise (digits, breast cancer, wine; symmetric and "
                    "class-dependent; 10% and 30%).")
    parser.add_argument("--quick", action="store_true",
                        help="fewer strategies and repetitions: under a minute per suite")
    parser.add_argument("--models", type=_csv(str), default=None,
                        help="models, comma-separated, from mlp, cnn, transformer, resnet, "
                             "mobilenet, text_cnn, gru, embedding_bag, for the engine, training "
                             "and monitor suites (default: engine mlp,cnn,transformer; training "
                             "and monitor cnn,transformer)")
    parser.add_argument("--batch-sizes", type=_csv(int), default=None,
                        help="engine batch sizes, comma-separated (default: per model: 64,256 "
                             "for mlp, cnn, transformer; 128 for resnet, mobilenet, gru; 256 "
                             "for text_cnn, embedding_bag)")
    parser.add_argument("--suites", type=_csv(str), default=("engine",),
                        help=f"which benchmarks, comma-separated from {','.join(SUITES)} "
                             "(default: engine)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write rows as JSON")


def run(args: argparse.Namespace) -> int:
    from pergrad.bench import engine, jacobian, label_errors, monitor, training
    from pergrad.bench.models import MODELS

    unknown = [m for m in args.models or () if m not in MODELS]
    bad_suites = [s for s in args.suites if s not in SUITES]
    if unknown or bad_suites or any(b < 1 for b in args.batch_sizes or ()):
        what = (f"unknown models {unknown}" if unknown else f"unknown suites {bad_suites}"
                if bad_suites else "batch sizes must be positive")
        print(f"pergrad bench: error: {what}", file=sys.stderr)
        return 2
    results = {}
    for suite in args.suites:
        print(f"# {suite}", flush=True)
        if suite == "engine":
            rows = engine.run(args.quick, args.models or ("mlp", "cnn", "transformer"),
                              args.batch_sizes)
            print(engine.markdown(rows))
        else:
            module = {"training": training, "monitor": monitor, "jacobian": jacobian,
                      "label-errors": label_errors}[suite]
            chosen = {"models": args.models} if args.models and suite in MODEL_SUITES else {}
            rows = module.run(quick=args.quick, **chosen)
            print(module.markdown(rows))
        results[suite] = rows
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0
