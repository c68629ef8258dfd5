"""The flags every decoding command shares (`python -m infer.generate`, `infer.eval`, `infer.teacher_forced`), declared
once as an argparse parent: one spelling, one type, one range check each."""

from __future__ import annotations

import argparse

from infer.loading import at_least, non_negative
from infer.spec import MAX_BLOCK


def decode_options(*, sampling: bool = True) -> argparse.ArgumentParser:
    """A parent parser (argparse's `parents=[...]`) with --target, --block, --truncate-prompts, --dtype and, with
    `sampling`, --temperature and --seed."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument(
        "--target", required=True, help="the target: an HF model directory, a .gguf file, or 'smollm2' (required)"
    )
    ap.add_argument(
        "--block",
        type=at_least(2, MAX_BLOCK),
        default=None,
        help="block size K (default: each drafter's own; n-gram 8)",
    )
    ap.add_argument(
        "--truncate-prompts",
        "--truncate-prompt",
        dest="truncate_prompts",
        action="store_true",
        help="cut a prompt too long for the target's positions (with --max-new-tokens and K) to its last tokens "
        "that fit, said on stderr and in the results (default: refused)",
    )
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="the target's compute dtype (default: its config's)",
    )
    if sampling:
        ap.add_argument(
            "--temperature",
            type=non_negative,
            default=0.0,
            help="sampling temperature of the target, plain and speculative alike (default 0: greedy, every answer "
            "checked token for token against plain decoding's where a command compares them)",
        )
        ap.add_argument(
            "--seed", type=int, default=0, help="sampling seed, and init seed of --draft random (default 0)"
        )
    return ap
