"""``pergrad privacy``: epsilon of a DP-SGD run, or the noise multiplier for a target epsilon."""

from __future__ import annotations

import argparse
import math
import sys

_DESCRIPTION = """\
Privacy accounting for DP-SGD with Poisson sampling: sampling rate q = batch_size / num_examples,
steps = floor(epochs) * ceil(num_examples / batch_size) + ceil(frac(epochs) * num_examples /
batch_size) (the batches pergrad.privacy.poisson_batches yields), Gaussian noise of std
noise_multiplier * clip norm per step. With --noise-multiplier, prints the epsilon spent at
--delta. With --target-epsilon, prints the smallest noise multiplier whose epsilon does not
exceed the target. The guarantee assumes Poisson-sampled batches
(pergrad.privacy.poisson_batches); for shuffled fixed-size batches the number is the customary
heuristic.
"""

_EXAMPLES = """\
examples:
  pergrad privacy --num-examples 60000 --batch-size 150 --noise-multiplier 1.3 --epochs 15 --delta 1e-5
  pergrad privacy --num-examples 60000 --batch-size 256 --target-epsilon 3 --epochs 60 --delta 1e-5 --accountant pld
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _positive_float(text: str) -> float:
    value = _float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = _float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a non-negative finite number, got {text}")
    return value


def _probability(text: str) -> float:
    value = _float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the ``privacy`` subcommand on an ``add_subparsers()`` object."""
    parser = subparsers.add_parser(
        "privacy",
        help="epsilon of DP-SGD training, or the noise multiplier for a target epsilon",
        description=_DESCRIPTION,
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--num-examples",
        type=_positive_int,
        required=True,
        metavar="N",
        help="number of training examples N",
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        required=True,
        metavar="B",
        help="expected batch size B (at most N); sampling rate q = B / N",
    )
    parser.add_argument(
        "--epochs",
        type=_positive_float,
        required=True,
        metavar="E",
        help="passes over the data (may be fractional); steps = floor(E) * ceil(N / B) + "
        "ceil(frac(E) * N / B)",
    )
    parser.add_argument(
        "--delta",
        type=_probability,
        required=True,
        metavar="D",
        help="target delta in (0, 1), conventionally below 1/N",
    )
    noise = parser.add_mutually_exclusive_group(required=True)
    noise.add_argument(
        "--noise-multiplier",
        type=_non_negative_float,
        metavar="SIGMA",
        help="noise std divided by the clip norm; prints the epsilon spent (give this or "
        "--target-epsilon)",
    )
    noise.add_argument(
        "--target-epsilon",
        type=_positive_float,
        metavar="EPS",
        help="privacy budget; prints the smallest noise multiplier that meets it (give this or "
        "--noise-multiplier)",
    )
    parser.add_argument(
        "--accountant",
        choices=("rdp", "pld"),
        default="rdp",
        help="rdp: Renyi DP (default, fast, the number TF Privacy reports); pld: privacy loss "
        "distributions (tighter, slower)",
    )
    parser.set_defaults(privacy_parser=parser)


def _fail(args: argparse.Namespace, message: str) -> int:
    parser = getattr(args, "privacy_parser", None)
    if parser is not None:
        parser.error(message)  # prints usage and the message to stderr, exits with code 2
    print(f"pergrad privacy: error: {message}", file=sys.stderr)
    return 2


def _steps_formula(n: int, b: int, e: float) -> str:
    """``floor(E) * ceil(N / B) + ceil(frac(E) * N / B)`` written out, omitting zero terms."""
    whole = math.floor(e)
    terms = [f"{whole} * ceil({n} / {b})"] if whole else []
    if e != whole:
        terms.append(f"ceil({e - whole:g} * {n} / {b})")
    return " + ".join(terms)


def run(args: argparse.Namespace) -> int:
    """Print the epsilon (or the calibrated noise multiplier) for ``args``; return the exit code."""
    from pergrad.privacy.accounting import dp_sgd_steps, epsilon, noise_multiplier_for

    n, b, e, delta = args.num_examples, args.batch_size, args.epochs, args.delta
    if b > n:
        return _fail(args, f"--batch-size ({b}) must not exceed --num-examples ({n})")
    if (args.noise_multiplier is None) == (args.target_epsilon is None):
        return _fail(args, "give exactly one of --noise-multiplier and --target-epsilon")
    setting = (
        f"{args.accountant} accountant, q = {b}/{n} = {b / n:.6g}, "
        f"steps = {_steps_formula(n, b, e)} = {dp_sgd_steps(n, b, e)}, delta = {delta:g}"
    )
    if args.target_epsilon is None:
        eps = epsilon(n, b, args.noise_multiplier, e, delta, args.accountant)
        print(f"epsilon: {eps:.6g}")
        print(
            f"  ({setting}, noise multiplier {args.noise_multiplier:g}; assumes Poisson sampling)"
        )
        return 0
    try:
        sigma = noise_multiplier_for(args.target_epsilon, n, b, e, delta, args.accountant)
    except ValueError as err:
        return _fail(args, str(err))
    # Round up, so the printed value itself meets the target.
    digits = 5 - math.floor(math.log10(sigma))
    sigma = math.ceil(sigma * 10**digits) / 10**digits
    eps = epsilon(n, b, sigma, e, delta, args.accountant)
    print(f"noise_multiplier: {sigma:.6g}")
    print(
        f"  ({setting}, epsilon {eps:.6g} <= target {args.target_epsilon:g}; "
        "assumes Poisson sampling)"
    )
    return 0
