"""``pergrad bench``: the benchmarks of every capability, ratios against same-run baselines."""

from __future__ import annotations

import argparse
import json
import os
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


SUITES = ("engine", "training", "monitor", "jacobian", "label-errors", "real-models")
# the suites that run on every backend (the others are TensorFlow benchmarks; on JAX also engine)
EVERY_BACKEND = ("real-models",)
MODEL_SUITES = ("training", "monitor", "real-models")  # besides the engine, those --models applies to


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
                             "and monitor cnn,transformer); for the real-models suite from bert, "
                             "bert_lora, gpt2, gpt2_lora, gemma, gemma_lora, mobilenet_v3_small, "
                             "efficientnet_v2_b0 (default: all)")
    parser.add_argument("--batch-sizes", type=_csv(int), default=None,
                        help="engine batch sizes, comma-separated (default: per model: 64,256 "
                             "for mlp, cnn, transformer; 128 for resnet, mobilenet, gru; 256 "
                             "for text_cnn, embedding_bag)")
    parser.add_argument("--suites", type=_csv(str), default=("engine",),
                        help=f"which benchmarks, comma-separated from {','.join(SUITES)} "
                             "(default: engine)")
    parser.add_argument("--backend", choices=("tensorflow", "jax", "torch"), default=None,
                        help="the Keras backend to benchmark (default: KERAS_BACKEND, else "
                             "tensorflow); on jax the engine suite also times the DP training "
                             "step against plain Keras and, if installed, JAX Privacy; the "
                             "real-models suite runs on every backend, the others on "
                             "tensorflow")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write rows as JSON")


def run(args: argparse.Namespace) -> int:
    backend = args.backend or os.environ.get("KERAS_BACKEND", "tensorflow")
    if set(args.suites) <= set(EVERY_BACKEND) and backend in ("jax", "torch"):
        return _run_on(backend, args)
    if backend == "jax":
        return _run_jax(args)
    if backend == "torch":
        print(f"pergrad bench: error: on the torch backend only {', '.join(EVERY_BACKEND)} runs "
              "(--suites real-models)", file=sys.stderr)
        return 2
    from pergrad.bench import engine, jacobian, label_errors, monitor, real_models, training
    from pergrad.bench.models import MODELS

    names = {suite: real_models.MODELS if suite == "real-models" else MODELS
             for suite in ("engine", *MODEL_SUITES)}
    unknown = sorted({m for m in args.models or () for suite in args.suites
                      if suite in names and m not in names[suite]})
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
                      "label-errors": label_errors, "real-models": real_models}[suite]
            chosen = {"models": args.models} if args.models and suite in MODEL_SUITES else {}
            rows = module.run(quick=args.quick, **chosen)
            print(module.markdown(rows))
        results[suite] = rows
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


def _run_on(backend: str, args: argparse.Namespace) -> int:
    """The backend-neutral suites (``EVERY_BACKEND``) on JAX or PyTorch, in this process."""
    if "keras" in sys.modules and sys.modules["keras"].backend.backend() != backend:
        print(f"pergrad bench: error: Keras is already running on another backend; run with "
              f"KERAS_BACKEND={backend}", file=sys.stderr)
        return 2
    os.environ["KERAS_BACKEND"] = backend
    from pergrad.backend import native

    native().enable_noise_keys()  # JAX: DP noise keys are 64-bit
    from pergrad.bench import real_models

    unknown = [m for m in args.models or () if m not in real_models.MODELS]
    if unknown:
        print(f"pergrad bench: error: unknown models {unknown}", file=sys.stderr)
        return 2
    print(f"# real-models ({backend})", flush=True)
    rows = real_models.run(quick=args.quick, models=args.models, echo=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"real-models": rows}, handle, indent=1)
    return 0


def _run_jax(args: argparse.Namespace) -> int:
    """The engine suite on the JAX backend (:mod:`pergrad.bench.jax_engine`), in this process:
    Keras has not been imported yet, so the backend can still be chosen."""
    if "keras" in sys.modules and sys.modules["keras"].backend.backend() != "jax":
        print("pergrad bench: error: Keras is already running on another backend; run with "
              "KERAS_BACKEND=jax", file=sys.stderr)
        return 2
    if tuple(args.suites) != ("engine",):
        print("pergrad bench: error: on the jax backend only the engine suite runs "
              "(--suites engine)", file=sys.stderr)
        return 2
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    jax.config.update("jax_enable_x64", True)  # DP noise keys are 64-bit
    from pergrad.bench import jax_engine
    from pergrad.bench.models import MODELS

    unknown = [m for m in args.models or () if m not in MODELS]
    if unknown:
        print(f"pergrad bench: error: unknown models {unknown}", file=sys.stderr)
        return 2
    print("# engine (jax)", flush=True)
    rows = jax_engine.run(args.quick, args.models, args.batch_sizes)
    print(jax_engine.markdown(rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"engine": rows}, handle, indent=1)
    return 0
