"""Replace conversations' assistant replies with the target's own greedy replies (DFlash trains on them).

  python -m train.regenerate --target PATH|smollm2 --input FILE.jsonl|sharegpt --output OUT.jsonl \\
      [--skip N] [--limit N] [--batch-size 8] [--max-new-tokens 256] [--max-prompt-tokens 512]

Each conversation is cut after its first user turn (system turns before it kept) and the first assistant reply
is regenerated; later turns are dropped. Regenerating a multi-turn conversation turn by turn costs one
generation per turn, each on a longer prompt; it is left for later. Output lines are
{id, messages: [...prompt, {role: assistant, content}], finish: "stop" | "length"} ("length": the reply hit
--max-new-tokens before an end-of-turn token).

Resumable: every line is flushed and fsynced; on restart the ids already in OUT.jsonl are skipped and a cut-off
last line is dropped. Batches are fixed chunks of the eligible conversations (grouped by prompt-length bucket,
input order within a bucket, so the file's order is that, not the input's), and a batch that
was cut mid-way is generated again whole (only its missing lines are written), so a resumed run writes the
same bytes as an uninterrupted one: the same prompts share a batch and a padded shape either way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from data.assets import target_file
from data.conversations import load_conversations
from data.pipeline import tokenizer_fingerprint
from dflash_model.cli import add_xla_flags, run_main
from dflash_model.files import atomic_write_json
from dflash_model.target import config_of
from dflash_model.tokenizer import chat_prompt_ids, load_tokenizer, stop_token_ids
from dflash_model.weights import load_target, load_target_config
from infer.loading import at_least
from infer.plain import PROMPT_BUCKETS, bucket_length, greedy_generate


def first_turn_prompt(messages: list[dict]) -> list[dict] | None:
    """The system turns before the first user turn and that user turn; None without a user turn."""
    for i, m in enumerate(messages):
        if m["role"] == "user":
            return [x for x in messages[:i] if x["role"] == "system"] + [m]
    return None


def read_done(out_path: str | Path, *, repair: bool = True) -> list[str]:
    """Ids already written to `out_path`, in order, after cutting off a partial last line (a crash mid-write; with
    repair=False it is only left out, the file untouched).

    A complete line that is not valid JSON is an error naming file:line: it is not a crash artefact.
    """
    path = Path(out_path)
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data) and repair:
        with path.open("r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    ids = []
    # split("\n"), not splitlines(): replies are written with ensure_ascii=False, so a U+2028 or U+0085 in a reply
    # is in the file as is, and splitlines() would cut its record in two.
    for lineno, line in enumerate(data[:end].decode("utf-8").split("\n")[:-1], 1):
        try:
            ids.append(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: not a regenerated record ({e})") from e
    return ids


def plan(conversations: list[dict], tok, max_prompt_tokens: int, *, thinking: bool = False):
    """(eligible [(id, prompt messages, prompt ids)], Counter of skips), grouped by prompt-length bucket.

    Batches pad every prompt to the bucket of their longest one, and prefill dominates the cost on a CPU, so
    prompts are ordered by bucket (input order within a bucket): a 40-token prompt is not padded to 512 for
    the sake of one long neighbour. The order depends only on the input, which keeps batches reproducible.
    """
    if max_prompt_tokens > PROMPT_BUCKETS[-1]:
        raise ValueError(
            f"max_prompt_tokens={max_prompt_tokens} exceeds the largest prompt bucket {PROMPT_BUCKETS[-1]}"
        )
    eligible, skipped, seen = [], Counter(), set()
    for conv in conversations:
        prompt = first_turn_prompt(conv["messages"])
        if prompt is None:
            skipped["no_user_turn"] += 1
            continue
        if conv["id"] in seen:
            skipped["duplicate_id"] += 1  # resume keys on ids, so an id must name one conversation
            continue
        ids = chat_prompt_ids(tok, prompt, thinking=thinking)
        if len(ids) > max_prompt_tokens:
            skipped["prompt_too_long"] += 1
            continue
        seen.add(conv["id"])
        eligible.append((conv["id"], prompt, ids))
    eligible.sort(key=lambda e: bucket_length(len(e[2])))  # stable: input order within a bucket
    return eligible, skipped


def check_lengths(target_cfg, max_prompt_tokens: int, max_new_tokens: int) -> None:
    """The longest prompt kept and its reply must fit the target's positions (past them RoPE runs on positions the
    model never saw: replies quietly wrong)."""
    positions = target_cfg.max_position_embeddings
    if max_new_tokens < 1 or max_prompt_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}, max_prompt_tokens={max_prompt_tokens}: each must be >= 1")
    if max_prompt_tokens + max_new_tokens > positions:
        raise ValueError(
            f"max_prompt_tokens={max_prompt_tokens} + max_new_tokens={max_new_tokens} = "
            f"{max_prompt_tokens + max_new_tokens} positions, more than the target's {positions}"
        )


def check_output(out_path: str | Path) -> None:
    """Refuse an output that cannot be appended to, before a model loads: a directory, or a file or directory
    this process cannot write. Nothing is written: a probe file in the directory is removed at once."""
    path = Path(out_path)
    if str(out_path).endswith(os.sep) or path.is_dir():
        raise ValueError(f"--output {out_path}: a directory; give the JSONL file to write")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
        if path.exists():
            with path.open("ab"):
                pass
    except OSError as e:
        raise ValueError(f"--output {out_path}: cannot be written ({e.strerror or e})") from None


def settings_path(out_path: str | Path) -> Path:
    return Path(f"{out_path}.settings.json")


def check_settings(out_path: str | Path, settings: dict) -> None:
    """Refuse to resume `out_path` under other settings (its replies would be mixed with ones made otherwise);
    record them beside it the first time (<out>.settings.json)."""
    side = settings_path(out_path)
    if side.is_file():
        # Files made before the dtype was recorded were all made in float32.
        old = {"dtype": "float32", **json.loads(side.read_text())}
        diff = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        if diff:
            said = "; ".join(f"{k}={a!r} there but {b!r} now" for k, (a, b) in diff.items())
            raise ValueError(
                f"{out_path}: its replies were made with other settings ({said}, per {side}); "
                "resuming would mix them. Give another output, or set them back"
            )
        return
    if Path(out_path).is_file() and Path(out_path).stat().st_size:
        print(
            f"{out_path}: no {side.name} beside it (made before settings were recorded); assuming it was made "
            "with these settings",
            file=sys.stderr,
        )
    atomic_write_json(side, settings)


def pending(conversations: list[dict], tok, out_path: str | Path, max_prompt_tokens: int, *, thinking=False) -> int:
    """How many replies `regenerate` would still write: eligible conversations (prompt within max_prompt_tokens)
    whose id is not yet in `out_path` (read only: `regenerate` repairs a torn last line, after checking settings)."""
    eligible, _ = plan(conversations, tok, max_prompt_tokens, thinking=thinking)
    done = set(read_done(out_path, repair=False))
    return sum(e[0] not in done for e in eligible)


def regenerate(
    model,
    tok,
    conversations: list[dict],
    out_path: str | Path,
    *,
    batch_size: int = 8,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 512,
    thinking: bool = False,
    progress: bool = True,
    target_name: str | None = None,
) -> dict:
    """Append the target's greedy first replies to `out_path` (resuming after the ids already there).

    A resume must use the settings the file was started with (target, tokenizer, lengths, batch size: checked
    against <out>.settings.json). `target_name` names the target there; None = a digest of its architecture.
    Returns counts: written, already_done, skipped (per reason), new_tokens, seconds (generation only).
    """
    if target_name is None:
        target_name = "arch-" + hashlib.sha256(repr(config_of(model)).encode()).hexdigest()[:16]
    check_lengths(config_of(model), max_prompt_tokens, max_new_tokens)
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    check_output(out_path)
    check_settings(
        out_path,
        {
            "target": target_name,
            "tokenizer": tokenizer_fingerprint(tok),
            "max_new_tokens": max_new_tokens,
            "max_prompt_tokens": max_prompt_tokens,
            "batch_size": batch_size,
            "thinking": thinking,
            "dtype": config_of(model).dtype,
        },
    )
    eligible, skipped = plan(conversations, tok, max_prompt_tokens, thinking=thinking)
    done = set(read_done(out_path))
    stops = tuple(stop_token_ids(tok))
    stats = {
        "written": 0,
        "already_done": sum(e[0] in done for e in eligible),
        "skipped": dict(skipped),
        "new_tokens": 0,
        "seconds": 0.0,
    }
    bar = tqdm(
        total=len(eligible), initial=stats["already_done"], unit="conv", disable=not progress, dynamic_ncols=True
    )
    with Path(out_path).open("a", encoding="utf-8") as out:
        for lo in range(0, len(eligible), batch_size):
            batch = eligible[lo : lo + batch_size]
            if all(e[0] in done for e in batch):
                continue
            # The last, short batch is filled with copies of its last prompt so every batch has one compiled
            # shape; the copies' replies are thrown away.
            prompts = [e[2] for e in batch] + [batch[-1][2]] * (batch_size - len(batch))
            t0 = time.perf_counter()
            replies = greedy_generate(model, prompts, max_new_tokens, stop_ids=stops, pad_id=tok.pad_token_id or 0)
            stats["seconds"] += time.perf_counter() - t0
            for (rid, prompt, _), reply in zip(batch, replies):
                if rid in done:
                    continue
                stopped = bool(reply) and reply[-1] in stops
                text = tok.decode(reply[:-1] if stopped else reply, skip_special_tokens=False)
                rec = {
                    "id": rid,
                    "messages": [*prompt, {"role": "assistant", "content": text}],
                    "finish": "stop" if stopped else "length",
                }
                out.write(json.dumps(rec, ensure_ascii=False) + "\n")
                out.flush()
                os.fsync(out.fileno())
                stats["written"] += 1
                stats["new_tokens"] += len(reply)
                bar.update(1)
            secs = max(stats["seconds"], 1e-9)
            bar.set_postfix(tok_s=f"{stats['new_tokens'] / secs:.0f}", conv_s=f"{stats['written'] / secs:.2f}")
    bar.close()
    return stats


def load(target: str, dtype: str | None = None):
    """(model, tokenizer) of a target name (`data.assets.target_file`: 'smollm2', an asset, an HF directory or a
    .gguf); dtype None = the checkpoint's own (float32 for a .gguf)."""
    target = target_file(target)
    _, model = load_target(target, dtype=dtype)
    return model, load_tokenizer(target)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m train.regenerate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", required=True, help="HF model directory, .gguf file, or 'smollm2'")
    ap.add_argument("--input", required=True, help="conversation JSONL, or 'sharegpt' (the packaged ShareGPT V3)")
    ap.add_argument("--output", required=True, help="JSONL to write (appended to when resuming)")
    ap.add_argument(
        "--skip", type=at_least(0), default=0, help="pass over the first N input records (e.g. another run's held-out)"
    )
    ap.add_argument(
        "--limit", type=at_least(1), default=None, help="read at most N input records (after the skipped ones)"
    )
    ap.add_argument("--batch-size", type=at_least(1), default=8)
    ap.add_argument("--max-new-tokens", type=at_least(1), default=256)
    ap.add_argument(
        "--max-prompt-tokens", type=at_least(1, PROMPT_BUCKETS[-1]), default=512, help="longer prompts are skipped"
    )
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="the target's weights and activations (default: the checkpoint's own; a .gguf's is float32). bfloat16 "
        "replies are the float32 target's greedy tokens at 98.7%% of positions (docs/results/code-cpu-6/) and, with "
        "--xla-flags set to oneDNN's on a CPU with AMX, come about 1.7x faster",
    )
    ap.add_argument(
        "--xla-flags",
        default="",
        help="appended to XLA_FLAGS before JAX starts (as the training config's xla_flags), e.g. "
        "'--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_custom_call=true' for bf16 on an AMX CPU",
    )
    args = ap.parse_args(argv)
    add_xla_flags(args.xla_flags)  # before anything starts a JAX backend
    check_output(args.output)
    target = target_file(args.target)
    check_lengths(load_target_config(target, dtype=args.dtype), args.max_prompt_tokens, args.max_new_tokens)
    conversations, dropped = load_conversations(args.input, limit=args.limit, skip=args.skip, require_assistant=False)
    model, tok = load(args.target, args.dtype)
    stats = regenerate(
        model,
        tok,
        conversations,
        args.output,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        target_name=args.target,
    )
    stats["dropped_input"] = dict(dropped)
    print(json.dumps(stats), file=sys.stderr)
    return stats


if __name__ == "__main__":
    run_main(main)
