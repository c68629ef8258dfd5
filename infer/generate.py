"""Generate from one prompt with a target and a proposer (DFlash drafter, n-gram, none).

  python -m infer.generate --target DIR|FILE.gguf|smollm2 --draft DIR|none|ngram|random \
      [--prompt TEXT | --prompt-ids 1,2,3] [--chat] --max-new-tokens N [--block K] \
      [--temperature T --seed S] [--json]

--json prints one JSON object: tokens (generated ids after the prompt), accept_lengths (committed tokens per
verify round, bonus included) and proposals (the K-1 drafted ids of each round), plus context fields.
"""

from __future__ import annotations

import argparse
import json
import sys

from dflash_model.cli import run_main
from dflash_model.tokenizer import chat_prompt_ids, stop_token_ids
from infer.engine import Engine
from infer.loading import DRAFT_HELP, at_least, check_prompt_ids, fit_prompts, load_draft_spec
from infer.options import decode_options
from infer.spec import check_positions
from infer.target_spec import load_target_spec


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m infer.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[decode_options()],
    )
    ap.add_argument(
        "--draft",
        default="none",
        help=f"the proposer: {DRAFT_HELP}",
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids (used as given)")
    ap.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template (thinking off)")
    ap.add_argument("--max-new-tokens", type=at_least(1), required=True)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    args = ap.parse_args(argv)
    if args.chat and args.prompt is None:
        ap.error("--chat needs --prompt TEXT")
    return args


def prompt_ids(args, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError as e:
            raise ValueError(f"--prompt-ids: expected comma-separated integers ({e})") from e
        if not ids:
            raise ValueError("--prompt-ids: empty")
        return ids
    if tokenizer is None:
        raise ValueError("this target has no tokenizer: pass --prompt-ids")
    if args.chat:
        return chat_prompt_ids(tokenizer, args.prompt)
    return tokenizer(args.prompt, add_special_tokens=False)["input_ids"]


def checked_inputs(args):
    """(target, draft, prompt ids), every input checked against the target's config before its weights load."""
    target = load_target_spec(args.target, args.dtype, weights=False)
    check_positions(1, args.max_new_tokens, args.block or 1, target.config.max_position_embeddings, "--max-new-tokens")
    ids = prompt_ids(args, target.tokenizer)
    name = "--prompt-ids" if args.prompt_ids is not None else "--prompt"
    check_prompt_ids([ids], target.config, names=[name])
    draft = load_draft_spec(args.draft, target.config, args.block, seed=args.seed)
    (ids,), _ = fit_prompts(
        [ids],
        target.config,
        max_new_tokens=args.max_new_tokens,
        width=draft.width,
        names=[name],
        truncate=args.truncate_prompts,
    )
    return target.load_weights(), draft, ids


def run(args) -> dict:
    target, draft, ids = checked_inputs(args)
    stop_ids = ()
    if target.tokenizer is not None:
        stop_ids = stop_token_ids(target.tokenizer)
    engine = Engine(
        target.model,
        draft.proposer,
        draft.params,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        stop_ids=stop_ids,
        **draft.engine_options(),
    )
    gen = engine.generate([ids], seed=args.seed)[0]
    result = {
        "tokens": gen.tokens,
        "accept_lengths": gen.accept_lengths,
        "proposals": gen.proposals,
        "verify_widths": gen.verify_widths,
        "prompt_ids": ids,
        "draft": draft.name,
        "block_size": engine.block_size,  # a tree size chosen at start-up: the chosen one's
        **({"tree_choice": engine.costs["tree_choice"]} if engine.costs and "tree_choice" in engine.costs else {}),
        "temperature": args.temperature,
        "mean_accept_length": (sum(gen.accept_lengths) / len(gen.accept_lengths)) if gen.accept_lengths else None,
    }
    if target.tokenizer is not None:
        result["text"] = target.tokenizer.decode(gen.tokens, skip_special_tokens=True)
    return result


def main(argv=None):
    args = parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        print(result.get("text", " ".join(map(str, result["tokens"]))))
        if result["accept_lengths"]:
            print(
                f"[{len(result['accept_lengths'])} rounds, mean accept length {result['mean_accept_length']:.2f}]",
                file=sys.stderr,
            )


if __name__ == "__main__":
    run_main(main)
