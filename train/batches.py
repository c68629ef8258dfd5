"""Training batches as a grain pipeline whose iterator state is checkpointed: synthetic records or data.pipeline.

A batch is numpy {input_ids [B,T] int32, loss_mask [B,T] bool, lengths [B] int32, anchors [B,N] int32 (-1 pads)}.
Anchors are drawn inside the pipeline by `random_map`, keyed on the record's index in the repeated, shuffled
stream: each epoch redraws them (the paper's recipe) and a restored iterator redraws exactly the same ones.
"""

from __future__ import annotations

import math

import grain
import jax
import numpy as np

from data import pipeline
from data.pipeline import sample_anchors  # the one anchor rule, for synthetic and conversation rows alike


def synthetic_record(index: int, *, seed: int, max_len: int, vocab_size: int, mask_token_id: int) -> dict:
    """A learnable fake conversation: one of a few fixed token cycles at a random phase, 5% of tokens replaced
    by noise, the first quarter a prompt outside the loss mask. A block's tokens follow from its first token,
    so a working drafter + objective must drive the loss well below log(V) within a few dozen steps."""
    cycles = np.random.default_rng(seed).choice(
        [v for v in range(min(vocab_size, 4096)) if v != mask_token_id], size=(4, 12), replace=False
    )
    rng = np.random.default_rng((seed, index))
    length = int(rng.integers(max_len // 2, max_len + 1))
    prompt = int(rng.integers(2, max(3, length // 4)))
    cycle = cycles[rng.integers(0, len(cycles))]
    toks = cycle[(int(rng.integers(0, cycle.size)) + np.arange(max_len)) % cycle.size]
    noise = rng.random(max_len) < 0.05
    toks = np.where(noise, cycles.reshape(-1)[rng.integers(0, cycles.size, max_len)], toks)
    pos = np.arange(max_len)
    toks = np.where(pos < length, toks, 0)
    return {
        "input_ids": toks.astype(np.int32),
        "loss_mask": (pos >= prompt) & (pos < length),
        "lengths": np.int32(length),
        "index": np.int32(index),  # row of the offline feature cache
    }


def _with_anchors(num_anchors: int, block_size: int):
    def fn(record: dict, rng: np.random.Generator) -> dict:
        return {**record, "anchors": sample_anchors(record["loss_mask"], num_anchors, block_size, rng)}

    return fn


def build_train_dataset(cfg, *, vocab_size: int, mask_token_id: int, tokenizer=None, records=None):
    """(grain IterDataset of this process's batches, batches per epoch, the unshuffled records: len() and [i],
    for the offline feature cache). records: `data.pipeline.TokenizedRecords` to train on instead of the data
    the config names (token ids already made, e.g. a target's own greedy text)."""
    t = cfg.train
    per_host_batch = int(t.batch_size) // jax.process_count()
    if records is not None:
        return _record_batches(cfg, records, None, per_host_batch)
    if cfg.data.source != "synthetic":
        return _conversation_batches(cfg, tokenizer, per_host_batch)
    base = grain.MapDataset.range(int(cfg.data.num_records)).map(
        lambda i: synthetic_record(
            int(i), seed=int(cfg.seed), max_len=int(t.max_len), vocab_size=vocab_size, mask_token_id=mask_token_id
        )
    )
    per_epoch = len(base) // int(t.batch_size)
    if per_epoch == 0:
        raise ValueError(f"{len(base)} records cannot fill one batch of {t.batch_size}")
    ds = (
        base.seed(int(cfg.seed))
        .repeat(int(t.epochs))
        .shuffle()
        .random_map(_with_anchors(int(cfg.num_anchors), int(cfg.block_size)))
    )
    ds = ds[jax.process_index() :: jax.process_count()]
    ds = ds.batch(per_host_batch, drop_remainder=True)
    return ds.to_iter_dataset(), per_epoch, base


def _conversation_batches(cfg, tokenizer, per_host_batch: int):
    """Chat-templated conversations with assistant-only loss masks from data.pipeline (its own shuffle, host
    sharding, per-epoch anchors and exact-resume iterator)."""
    if tokenizer is None:
        raise ValueError("a conversation data source needs a tokenizer (data.tokenizer or a GGUF/HF target)")
    limit = None if cfg.data.limit is None else int(cfg.data.limit)
    records = pipeline.load_tokenized(
        cfg.data.source, tokenizer, int(cfg.train.max_len), limit=limit, skip=int(cfg.data.skip)
    )
    return _record_batches(cfg, records, tokenizer, per_host_batch)


def _record_batches(cfg, records, tokenizer, per_host_batch: int):
    per_epoch = (len(records) // jax.process_count()) // per_host_batch
    ds = pipeline.build_dataset(
        records,
        tokenizer,
        int(cfg.train.max_len),
        per_host_batch,
        int(cfg.seed),
        num_epochs=int(cfg.train.epochs),
        num_anchors=int(cfg.num_anchors),
        block_size=int(cfg.block_size),
    )
    return ds, per_epoch, records


def kept_anchors(anchors_BN: np.ndarray, buckets: int) -> int:
    """How many of a batch's N anchor columns to run: the most real anchors of any row, rounded up to a multiple
    of ceil(N / buckets), so a step takes one of at most `buckets` shapes (each compiles once).

    Anchors are drawn sorted with the -1 padding last (`sample_anchors`), and a padding block has no label, so
    dropping padding columns leaves the loss and its gradient unchanged: the drafter and the cross-entropy, most
    of a step, then skip blocks that would train nothing (rows shorter than num_anchors x a few tokens of reply).
    """
    n = anchors_BN.shape[1]
    quantum = math.ceil(n / max(1, int(buckets)))
    real = int((np.asarray(anchors_BN) >= 0).sum(axis=1).max(initial=0))
    return min(n, max(1, math.ceil(real / quantum)) * quantum)
