"""Reply lookup: drafts from replies the target wrote for other prompts, for rounds where prompt lookup finds no
match in the row's own context.

Prompt lookup copies text the row has already seen. Much of what a chat model writes is not in its prompt but
recurs across its replies: openings ("Sure! Here's"), list and code formatting, its idioms. SuffixDecoding (arXiv
2411.04975) drafts from a suffix tree over earlier outputs. This is the simplest form of that idea that runs inside
the jitted decode loop: a table of the target's replies' n-grams (n = min_n..max_n, hashed to uint32, sorted) that
maps each to the token that most often followed it and how often (`prob`); a draft extends the row's last tokens
one token at a time from the longest n-gram found, with `jnp.searchsorted`. No JAX library offers such an index,
so it is written here.

A hash collision can only make a draft wrong, never an output: the target verifies every draft.

`python -m infer.replies` stores a set of replies (a JSONL of conversations, e.g. `train.regenerate`'s output,
tokenized with the target's chat template) as the compact file `--draft replies:FILE` reads; the index is built
from it at load (0.3 s for the shipped file's 650k reply tokens). Dimension letters: docs/glossary.md; A = entries
of the index.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
import zlib
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
import numpy as np

from dflash_model.files import atomic_writer
from dflash_model.hashing import mix32

# Context tokens kept before each reply in a stored file: the longest n-gram an index can use.
MAX_ORDER = 8
FORMAT = 1  # bump when the stored file's layout changes

_FNV_PRIME = 0x01000193


def ngram_hash(tokens, xp=np):
    """uint32 hash of each row's n-gram: tokens [..., n] (n = the order; it seeds the hash, so n-grams of different
    orders share one table). numpy and jax give the same value (uint32 arithmetic wraps in both)."""
    n = tokens.shape[-1]
    with np.errstate(over="ignore"):  # numpy warns on a 0-d array's wrap-around; it is the point here
        h = xp.full(tokens.shape[:-1], np.uint32(0x811C9DC5 ^ n), dtype=xp.uint32)
        for j in range(n):
            h = (h ^ tokens[..., j].astype(xp.uint32)) * np.uint32(_FNV_PRIME)
        return mix32(h)


# Followers kept per n-gram, most frequent first: a chain drafts the first, a lookup tree branches over all of them.
FOLLOWERS = 4


@flax.struct.dataclass
class ReplyIndex:
    keys_A: jax.Array  # [A] uint32 n-gram hashes, ascending
    next_AO: jax.Array  # [A, O] int32 the tokens that most often followed the n-gram, most frequent first
    prob_AO: jax.Array  # [A, O] fp32 how often each did (its count / the n-gram's count); 0 = no such follower
    min_n: int = flax.struct.field(pytree_node=False, default=2)
    max_n: int = flax.struct.field(pytree_node=False, default=4)


def build_index(input_ids, loss_mask, offsets, *, min_n: int = 2, max_n: int = 4) -> ReplyIndex:
    """The index of every reply token (loss_mask) under each of its preceding n-grams, n = min_n..max_n, inside
    its own record (TokenizedRecords' flat layout: record i is offsets[i]:offsets[i+1]). Ties between followers
    go to the smaller token id, so the index is a function of the data alone."""
    if not 1 <= min_n <= max_n <= MAX_ORDER:
        raise ValueError(f"reply lookup needs 1 <= min_n <= max_n <= {MAX_ORDER}, got {min_n}..{max_n}")
    ids = np.asarray(input_ids, np.int64)
    offsets = np.asarray(offsets, np.int64)
    record_start = np.repeat(offsets[:-1], np.diff(offsets))  # [sum T] where each position's record begins
    pos = np.nonzero(np.asarray(loss_mask, bool))[0]
    keys, nexts = [], []
    for n in range(min_n, max_n + 1):
        p = pos[pos - n >= record_start[pos]]  # the n context tokens lie inside the record
        window = ids[p[:, None] - n + np.arange(n)[None, :]]
        keys.append(ngram_hash(window.astype(np.uint32)))
        nexts.append(ids[p])
    key = np.concatenate(keys).astype(np.uint64)
    pair, count = np.unique((key << np.uint64(32)) | np.concatenate(nexts).astype(np.uint64), return_counts=True)
    key, token = (pair >> np.uint64(32)).astype(np.uint32), (pair & np.uint64(0xFFFFFFFF)).astype(np.int32)
    order = np.lexsort((-count, key))  # by key, then the most frequent follower first (stable: smaller id on ties)
    key, token, count = key[order], token[order], count[order]
    first = np.concatenate([[True], key[1:] != key[:-1]]) if len(key) else np.zeros(0, bool)
    starts = np.nonzero(first)[0]
    total = np.add.reduceat(count, starts) if len(key) else np.zeros(0, np.int64)
    group = np.cumsum(first) - 1  # [pairs] which n-gram each (n-gram, follower) pair belongs to
    rank = np.arange(len(key)) - starts[group] if len(key) else np.zeros(0, np.int64)
    keep = rank < FOLLOWERS
    next_AO = np.zeros((len(starts), FOLLOWERS), np.int32)
    prob_AO = np.zeros((len(starts), FOLLOWERS), np.float32)
    next_AO[group[keep], rank[keep]] = token[keep]
    prob_AO[group[keep], rank[keep]] = count[keep] / total[group[keep]]
    return ReplyIndex(jnp.asarray(key[first]), jnp.asarray(next_AO), jnp.asarray(prob_AO), min_n=min_n, max_n=max_n)


def find(index: ReplyIndex, tail_BN, avail_B):
    """The longest n-gram of each row's tail found in the index: ([B] follower, [B] its prob, [B] found).
    tail_BN: the row's last max_n tokens (oldest first); avail_B: how many of them are real (a short history)."""
    token_BO, prob_BO, order_B = followers(index, tail_BN, avail_B)
    return token_BO[:, 0], prob_BO[:, 0], order_B > 0


def followers(index: ReplyIndex, tail_BN, avail_B):
    """The followers of the longest n-gram of each row's tail found in the index: ([B, O] tokens, most frequent
    first, [B, O] how often each followed it (0: none), [B] the n-gram's order n; 0 = none found)."""
    b = tail_BN.shape[0]
    token = jnp.zeros((b, FOLLOWERS), jnp.int32)
    prob = jnp.zeros((b, FOLLOWERS), jnp.float32)
    order = jnp.zeros((b,), jnp.int32)
    size = index.keys_A.shape[0]
    if size == 0:  # a file with no replies finds nothing
        return token, prob, order
    for n in range(index.max_n, index.min_n - 1, -1):  # longest first: a row keeps its first hit
        h = ngram_hash(tail_BN[:, -n:], jnp)
        at = jnp.clip(jnp.searchsorted(index.keys_A, h), 0, size - 1)
        hit = (index.keys_A[at] == h) & (avail_B >= n) & (order == 0)
        token = jnp.where(hit[:, None], index.next_AO[at], token)
        prob = jnp.where(hit[:, None], index.prob_AO[at], prob)
        order = jnp.where(hit, n, order)
    return token, prob, order


def row_tails(history_BC, n_B, n: int):
    """[B, n] each row's last n committed tokens (history_BC[b, n_B[b]-n : n_B[b]], oldest first); a row shorter
    than n repeats its first token in front (callers count how many are real)."""
    return jnp.take_along_axis(history_BC, jnp.maximum(n_B[:, None] - n + jnp.arange(n)[None, :], 0), axis=1)


def continue_rows(index: ReplyIndex, history_BC, n_B, steps: int):
    """Each row's committed sequence (history_BC[b, :n_B[b]]) extended `steps` tokens by the index, each from the
    tokens before it, drafts included: ([B, steps] tokens, [B] prob of the first, [B] whether the first was found).
    Where the index has no n-gram the row's last token is repeated (any draft is free to be wrong)."""
    b = history_BC.shape[0]
    if steps == 0:  # K = 1: nothing to draft
        return jnp.zeros((b, 0), jnp.int32), jnp.zeros((b,), jnp.float32), jnp.zeros((b,), bool)
    tail = row_tails(history_BC, n_B, index.max_n)
    avail = jnp.minimum(n_B, index.max_n)
    out = []
    for s in range(steps):
        token, prob, found = find(index, tail, avail)
        token = jnp.where(found, token, tail[:, -1])
        if s == 0:
            first_prob, first_found = prob, found
        out.append(token)
        tail = jnp.concatenate([tail[:, 1:], token[:, None]], axis=1)
        avail = jnp.minimum(avail + 1, index.max_n)
    return jnp.stack(out, axis=1).astype(jnp.int32), first_prob, first_found


def stored_replies(records) -> dict[str, np.ndarray]:
    """The arrays a reply file keeps of TokenizedRecords: each assistant span with the MAX_ORDER tokens before it
    (its role header; the context its first tokens are looked up under), as records of their own."""
    ids_all, mask_all, offsets = records.arrays
    ids, mask, lengths = [], [], []
    for i in range(len(offsets) - 1):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        m = np.asarray(mask_all[lo:hi], bool)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], m.astype(np.int8), [0]])))
        for start, stop in zip(edges[::2], edges[1::2]):
            begin = max(0, start - MAX_ORDER)
            ids.append(np.asarray(ids_all[lo + begin : lo + stop], np.int32))
            mask.append(np.arange(begin, stop) >= start)  # an earlier span in its context is context only
            lengths.append(stop - begin)
    offs = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offs[1:])
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)
    return {"input_ids": cat(ids, np.int32), "loss_mask": cat(mask, bool), "offsets": offs}


def save_replies(path: Path, arrays: dict[str, np.ndarray], vocab_size: int) -> None:
    with atomic_writer(path) as f:  # a crash leaves the old file or the new one
        np.savez_compressed(f, format=np.int64(FORMAT), vocab_size=np.int64(vocab_size), **arrays)


def load_replies(path, vocab_size: int) -> dict[str, np.ndarray]:
    """The arrays of a reply file written by `python -m infer.replies`, checked against the target's vocabulary
    and for a layout the index can use (`check_replies`): a damaged file is named, not read as drafts."""
    path = Path(path).expanduser()
    try:
        with np.load(path) as z:
            fmt, vocab = int(z["format"]), int(z["vocab_size"])
            arrays = {k: z[k] for k in ("input_ids", "loss_mask", "offsets")}
    # A file cut short: BadZipFile (no central directory), EOFError or zlib.error (a member cut mid-way).
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise ValueError(f"{path}: not a reply file written by `python -m infer.replies` ({e})") from None
    if fmt != FORMAT:
        raise ValueError(f"{path}: reply file format {fmt}, this code reads {FORMAT}: rebuild it")
    if vocab != vocab_size:
        raise ValueError(f"{path}: its replies were tokenized for a vocabulary of {vocab}, the target has {vocab_size}")
    check_replies(path, arrays, vocab_size)
    return arrays


def check_replies(path, arrays: dict[str, np.ndarray], vocab_size: int) -> None:
    """A reply file's arrays as `stored_replies` writes them: 1-D, ids in 0..V-1 (an id outside it would index past
    the target's embedding), one mask entry per id, offsets from 0 to the number of ids, never decreasing."""
    ids, mask, offsets = (np.asarray(arrays[k]) for k in ("input_ids", "loss_mask", "offsets"))
    problem = None
    if ids.ndim != 1 or mask.shape != ids.shape or offsets.ndim != 1 or offsets.size < 1:
        problem = f"arrays of shapes {ids.shape}, {mask.shape}, {offsets.shape}: expected [N], [N] and [R + 1]"
    elif ids.size and not (0 <= ids.min() and ids.max() < vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        problem = f"token id {int(bad[0])} is outside the vocabulary 0..{vocab_size - 1} ({bad.size} such ids)"
    elif offsets[0] != 0 or offsets[-1] != ids.size or np.any(np.diff(offsets) < 0):
        problem = (
            f"offsets must rise from 0 to the {ids.size} ids, got {offsets[:3].tolist()}..{offsets[-1:].tolist()}"
            f" (lowest {int(offsets.min())})"
        )
    if problem:
        raise ValueError(f"{path}: a damaged reply file: {problem}; rebuild it with `python -m infer.replies`")


def concat_replies(first: dict[str, np.ndarray], second: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Two reply files' arrays as one: the second's records after the first's."""
    offsets = np.concatenate([first["offsets"], second["offsets"][1:] + first["offsets"][-1]])
    ids = np.concatenate([first["input_ids"], second["input_ids"]]).astype(np.int32)
    return {
        "input_ids": ids,
        "loss_mask": np.concatenate([first["loss_mask"], second["loss_mask"]]),
        "offsets": offsets,
    }


def load_index(path, vocab_size: int, *, min_n: int = 2, max_n: int = 4) -> ReplyIndex:
    """The index of a reply file written by `python -m infer.replies`, checked against the target's vocabulary."""
    return build_index(**load_replies(path, vocab_size), min_n=min_n, max_n=max_n)


def main(argv=None) -> int:
    from data.conversations import load_conversations
    from data.pipeline import tokenize_all
    from infer.target_spec import load_target_spec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m infer.replies")
    ap.add_argument("--target", default="smollm2", help="smollm2, an HF model directory or a .gguf (its tokenizer)")
    ap.add_argument("--input", required=True, help="a JSONL of conversations (their assistant turns are stored)")
    ap.add_argument("--skip", type=int, default=0, help="records passed over first")
    ap.add_argument("--limit", type=int, default=None, help="records read after the skipped ones")
    ap.add_argument("--max-len", type=int, default=4096, help="tokens kept of each conversation")
    ap.add_argument("--out", required=True, type=Path, help="the reply file (.npz) to write")
    ap.add_argument("--base", type=Path, default=None, help="a reply file whose replies come first (to grow it)")
    args = ap.parse_args(argv)
    target = load_target_spec(args.target, weights=False)  # its tokenizer and vocabulary: no weights needed here
    if target.tokenizer is None:
        raise SystemExit(f"--target {args.target}: no tokenizer, so its chat template cannot be applied")
    tokenizer, vocab_size = target.tokenizer, target.config.vocab_size
    convs, _ = load_conversations(args.input, limit=args.limit, skip=args.skip)
    records, _ = tokenize_all(convs, tokenizer, args.max_len)
    arrays = stored_replies(records)
    if args.base is not None:
        try:
            arrays = concat_replies(load_replies(args.base, vocab_size), arrays)
        except ValueError as e:
            raise SystemExit(f"--base {e}") from None
    save_replies(args.out, arrays, vocab_size)
    replies, tokens = len(arrays["offsets"]) - 1, int(arrays["loss_mask"].sum())
    size_mb = args.out.stat().st_size / 1e6
    print(f"{args.out}: {replies} replies, {tokens} reply tokens, {size_mb:.2f} MB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from dflash_model.cli import run_main

    raise SystemExit(run_main(main))
