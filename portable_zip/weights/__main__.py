"""python -m portable_zip.weights: the weight-sync example (example.py)."""
import argparse
import sys

from .example import DEFAULT_STEPS, main


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m portable_zip.weights",
        description="The weight-sync example, on two local CPU processes over gloo: rank 0 trains a small model "
                    "with AdamW and sends its bf16 weights after each step through pz.weights.Sender, rank 1 "
                    "receives them in place. Prints what each step sent and why, then checks the receiver's copy "
                    "against the sender's bit for bit.")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="N",
                   help="weight syncs to run: the first is full, the later ones deltas (default: %(default)s)")
    return p


if __name__ == "__main__":
    args = parser().parse_args()
    if args.steps < 1:
        parser().error(f"--steps must be at least 1, got {args.steps}")
    sys.exit(main(args.steps))
