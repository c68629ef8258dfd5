"""Grain input pipeline for drafter training: cached tokenization, per-host sharding, epochs, anchors, batches.

Design:
- Fixed-length rows: every sequence is right-padded to `max_len`, no packing. A DFlash block attends to the
  target features of its own sequence strictly before its anchor; packing would need segment ids threaded
  through the target forward and the drafter's block mask, and one static shape [B, max_len] keeps the train
  step to a single compile. The price is padding compute on short sequences.
- One global stream, the same on every host because it depends only on `seed`: records -> shuffle (a new
  permutation every epoch) -> repeat for `num_epochs` -> cut to a whole number of global batches
  (batch_size * shard_count rows) -> pad -> anchors. A host takes the stride `[shard_index::shard_count]` of it
  and batches that, so the rows of global step s are the stream's rows s*G .. s*G+G-1 (G the global batch)
  whatever the host count: 1 or N processes train on the same global batches (in a different row order).
  The cut gives every host the same number of batches, which a multi-host step needs (a host that ran out
  first would hang the others in a collective); it drops at most G - 1 rows at the very end, the rows a
  single host's drop-remainder batching drops.
- Anchors are drawn by a grain `random_map` on the global stream: grain seeds a Philox generator from
  (anchor_seed, k), where k is the element's position in the repeated global stream and
  anchor_seed = np.random.SeedSequence([seed, 0]).generate_state(1)[0]. The same seed gives the same
  anchors on any number of hosts; the same record gets new anchors in the next epoch because its k differs; a
  resumed iterator redraws exactly what the uninterrupted one drew.
- Tokenized records are cached as flat .npy files (memory-mapped, so grain worker processes share the pages)
  in a directory next to the input, named by a hash of the input's content, the tokenizer, its chat
  template, max_len and the thinking flag: any change tokenizes again, nothing is ever stale.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import grain
import jax
import numpy as np

from data import assets
from data.conversations import load_conversations, tokenize_conversation
from dflash_model.files import atomic_write_text, sha256_file

log = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when the tokenization or the cache layout changes


class TokenizedRecords:
    """Random-access grain source over tokenized conversations stored as flat arrays.

    input_ids int32 [sum T_i], loss_mask bool [sum T_i], offsets int64 [N + 1] (record i is
    offsets[i]:offsets[i+1]). Backed by memory or by a cache directory of .npy files opened lazily with mmap,
    so pickling it to a grain worker process sends only the path.
    """

    FILES = ("input_ids", "loss_mask", "offsets")

    def __init__(self, input_ids=None, loss_mask=None, offsets=None, ids: Sequence[str] = (), directory=None):
        self.directory = None if directory is None else Path(directory)
        self._arrays = None if directory is not None else (input_ids, loss_mask, offsets)
        self.ids = list(ids)

    @classmethod
    def from_examples(cls, examples: Sequence[dict], ids: Sequence[str] = ()) -> TokenizedRecords:
        offsets = np.zeros(len(examples) + 1, np.int64)
        np.cumsum([len(e["input_ids"]) for e in examples], out=offsets[1:])

        def flat(key, dtype):
            return np.concatenate([np.asarray(e[key], dtype) for e in examples] or [np.zeros(0, dtype)])

        return cls(flat("input_ids", np.int32), flat("loss_mask", bool), offsets, ids)

    @classmethod
    def load(cls, directory) -> TokenizedRecords:
        directory = Path(directory)
        ids = json.loads((directory / "ids.json").read_text())
        return cls(directory=directory, ids=ids)

    def save(self, directory) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name, arr in zip(self.FILES, self.arrays):
            np.save(directory / f"{name}.npy", arr)
        atomic_write_text(directory / "ids.json", json.dumps(self.ids))

    @property
    def arrays(self):
        if self._arrays is None:
            self._arrays = tuple(np.load(self.directory / f"{n}.npy", mmap_mode="r") for n in self.FILES)
        return self._arrays

    def __getstate__(self):
        state = dict(self.__dict__)
        if self.directory is not None:
            state["_arrays"] = None  # reopened by mmap in the receiving process
        return state

    def __len__(self) -> int:
        return len(self.arrays[2]) - 1

    def __getitem__(self, i: int) -> dict:
        ids, mask, offsets = self.arrays
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        return {"input_ids": np.asarray(ids[lo:hi]), "loss_mask": np.asarray(mask[lo:hi]), "index": np.int32(i)}


def anchor_candidates(loss_mask) -> int:
    """Number of positions a with loss_mask[a] and loss_mask[a+1] (ignoring the block-fit rule)."""
    m = np.asarray(loss_mask, bool)
    return int(np.count_nonzero(m[:-1] & m[1:]))


def tokenize_all(conversations: Sequence[dict], tok, max_len: int, thinking: bool = False):
    """TokenizedRecords of normalised conversations and the count of dropped ones per reason.

    "template": the assistant spans could not be located; "no_anchor": after truncation to max_len fewer than
    two consecutive loss tokens remain (e.g. a prompt longer than max_len), so no block could be trained.
    """
    examples, ids, dropped = [], [], Counter()
    for conv in conversations:
        try:
            ex = tokenize_conversation(tok, conv["messages"], max_len, thinking)
        except ValueError:
            dropped["template"] += 1
            continue
        if anchor_candidates(ex["loss_mask"]) == 0:
            dropped["no_anchor"] += 1
            continue
        examples.append(ex)
        ids.append(conv["id"])
    if dropped:
        log.warning(
            "tokenization dropped %d of %d conversations (%s)", sum(dropped.values()), len(conversations), dict(dropped)
        )
    return TokenizedRecords.from_examples(examples, ids), dropped


def tokenizer_fingerprint(tok) -> str:
    """Hash of everything that decides token ids and the rendering: vocab + merges + specials, chat template."""
    backend = getattr(tok, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    h = hashlib.sha256(body.encode())
    h.update(str(getattr(tok, "chat_template", "")).encode())
    return h.hexdigest()


def cache_key(source_digest: str, tok, max_len: int, thinking: bool, limit: int | None, skip: int = 0) -> str:
    parts = [str(CACHE_FORMAT), source_digest, tokenizer_fingerprint(tok), str(max_len), str(thinking), str(limit)]
    if skip:
        parts.append(f"skip={skip}")  # only when set: caches made before `skip` existed keep their keys
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _source_file(source) -> Path | None:
    if isinstance(source, str) and source == "sharegpt":
        return assets.path("sharegpt")
    if isinstance(source, str | Path):
        path = Path(source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"data source {str(source)!r}: no such file")
        return path
    return None


def load_tokenized(
    source, tok, max_len: int, *, thinking: bool = False, limit: int | None = None, cache_dir=None, skip: int = 0
) -> TokenizedRecords:
    """Tokenized records of a JSONL path, "sharegpt", or a list of raw records, through the on-disk cache.

    Files are cached in `cache_dir` or else next to the file (`<name>.tok-<key>/`); record lists only when
    `cache_dir` is given. A directory that cannot be written is a warning, not an error.
    """
    path = _source_file(source)
    if path is not None:
        digest, parent = sha256_file(path), Path(cache_dir) if cache_dir else path.parent
    elif cache_dir is not None:
        digest, parent = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest(), Path(cache_dir)
    else:
        digest = parent = None
    target = None
    if parent is not None:
        name = path.name if path is not None else "records"
        target = parent / f"{name}.tok-{cache_key(digest, tok, max_len, thinking, limit, skip)}"
        cached = open_cache(target)
        if cached is not None:
            return cached
    convs, _ = load_conversations(source, limit=limit, skip=skip)
    records, _ = tokenize_all(convs, tok, max_len, thinking)
    if target is not None:
        _save_atomically(records, target)
        if (target / "ids.json").is_file():
            return TokenizedRecords.load(target)  # the first run behaves like later ones: mmap, cheap to pickle
    return records


def open_cache(target: Path) -> TokenizedRecords | None:
    """The token cache at `target`, or None where there is none or it is damaged (a file cut short, edited or
    missing): a damaged one is said, naming it, and moved out of the way so that it is rebuilt."""
    if not (target / "ids.json").is_file():
        return None
    try:
        records = TokenizedRecords.load(target)
        ids, mask, offsets = records.arrays
        if not (ids.ndim == mask.ndim == offsets.ndim == 1 and ids.shape == mask.shape):
            raise ValueError(f"arrays of shapes {ids.shape}, {mask.shape}, {offsets.shape}")
        if len(offsets) != len(records.ids) + 1 or offsets[0] != 0 or offsets[-1] != len(ids):
            raise ValueError(f"{len(offsets)} offsets ending at {offsets[-1]} for {len(records.ids)} records")
        return records
    except (OSError, ValueError, IndexError, EOFError) as e:  # json.JSONDecodeError is a ValueError
        log.warning("the token cache %s is damaged (%s); rebuilding it", target, e)
    shutil.rmtree(target, ignore_errors=True)
    return None


def _save_atomically(records: TokenizedRecords, target: Path) -> None:
    # Written beside the target and renamed, so a crash or a second host writing the same cache never leaves a
    # half directory behind the final name; ids.json is what marks a finished cache.
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        records.save(tmp)
        os.replace(tmp, target)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "ids.json").is_file():
            log.warning("could not write the tokenization cache %s: %s", target, e)


def sample_anchors(loss_mask, num_anchors: int, block_size: int, rng: np.random.Generator) -> np.ndarray:
    """int32 [num_anchors]: sorted anchor positions a, drawn without replacement, -1 where fewer exist.

    The one anchor rule of the project (synthetic and conversation rows alike). The reference trainers
    (SpecForge's DFlash) draw a with loss_mask[a] set and the block a .. a+block_size-1 inside the padded [T] row
    (a + block_size <= T; labels past the sequence's end are padding, masked out). This rule adds loss_mask[a+1]:
    the token after the anchor is a label, so no drawn block trains nothing.
    """
    m = np.asarray(loss_mask, bool)
    t = m.shape[0]
    ok = np.zeros(t, bool)
    ok[:-1] = m[:-1] & m[1:]
    ok[max(t - block_size + 1, 0) :] = False
    valid = np.flatnonzero(ok)
    if len(valid) > num_anchors:
        valid = np.sort(rng.choice(valid, num_anchors, replace=False))
    out = np.full(num_anchors, -1, np.int32)
    out[: len(valid)] = valid
    return out


class _PadTo(grain.transforms.Map):
    def __init__(self, max_len: int, pad_id: int):
        self.max_len, self.pad_id = max_len, pad_id

    def map(self, rec):
        n = len(rec["input_ids"])
        if n > self.max_len:
            raise ValueError(
                f"record {int(rec['index'])} has {n} tokens, more than max_len={self.max_len}: "
                "it was tokenized for a longer max_len"
            )
        ids = np.full(self.max_len, self.pad_id, np.int32)
        mask = np.zeros(self.max_len, bool)
        ids[:n], mask[:n] = rec["input_ids"], rec["loss_mask"]
        return {"input_ids": ids, "loss_mask": mask, "lengths": np.int32(n), "index": rec["index"]}


class _Anchors(grain.transforms.RandomMap):
    def __init__(self, num_anchors: int, block_size: int):
        self.num_anchors, self.block_size = num_anchors, block_size

    def random_map(self, rec, rng: np.random.Generator):
        return rec | {"anchors": sample_anchors(rec["loss_mask"], self.num_anchors, self.block_size, rng)}


def anchor_seed(seed: int, shard_index: int) -> int:
    return int(np.random.SeedSequence([seed, shard_index]).generate_state(1)[0])


def build_dataset(
    records_or_path,
    tok,
    max_len: int,
    batch_size: int,
    seed: int,
    num_epochs: int | None = 1,
    shard_index: int | None = None,
    shard_count: int | None = None,
    *,
    num_anchors: int | None = None,
    block_size: int = 16,
    thinking: bool = False,
    limit: int | None = None,
    cache_dir=None,
    read_options: grain.ReadOptions | None = None,
) -> grain.IterDataset:
    """This host's batches: {input_ids int32 [B, max_len], loss_mask bool [B, max_len], lengths int32 [B],
    index int32 [B] (row in the tokenized records), anchors int32 [B, num_anchors] when num_anchors is set}.

    `records_or_path`: a JSONL path, "sharegpt", a list of raw records, or TokenizedRecords. shard_index and
    shard_count default to jax.process_index() / jax.process_count(). num_epochs=None repeats forever.
    The iterator's get_state()/set_state() resume exactly (see the module docstring for the order).
    """
    if shard_index is None or shard_count is None:
        shard_index = jax.process_index() if shard_index is None else shard_index
        shard_count = jax.process_count() if shard_count is None else shard_count
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index={shard_index} outside [0, shard_count={shard_count})")
    if isinstance(records_or_path, TokenizedRecords):
        records = records_or_path
    else:
        records = load_tokenized(records_or_path, tok, max_len, thinking=thinking, limit=limit, cache_dir=cache_dir)
    per_host = len(records) // shard_count
    if per_host < batch_size:
        raise ValueError(
            f"{len(records)} records over {shard_count} hosts leave {per_host} per host, "
            f"fewer than one batch of {batch_size}"
        )
    pad_id = getattr(tok, "pad_token_id", None) if tok is not None else None
    ds = grain.MapDataset.source(records).seed(seed).shuffle().repeat(num_epochs)
    if num_epochs is not None:
        ds = ds[: len(ds) - len(ds) % (batch_size * shard_count)]
    ds = ds.map(_PadTo(max_len, 0 if pad_id is None else int(pad_id)))
    if num_anchors:  # drawn on the global stream (one seed for all hosts): independent of the host count
        ds = ds.random_map(_Anchors(num_anchors, block_size), seed=anchor_seed(seed, 0))
    ds = ds[shard_index::shard_count].batch(batch_size, drop_remainder=True)
    # Records sit in memory or page cache: two threads keep up with a train step without fighting it for cores.
    return ds.to_iter_dataset(read_options or grain.ReadOptions(num_threads=2, prefetch_buffer_size=8))
