"""Training batches as a grain pipeline whose iterator state is checkpointed (data.pipeline), over conversations,
given records or synthetic ones.

A batch is numpy {input_ids [B,T] int32, loss_mask [B,T] bool, lengths [B] int32, anchors [B,N] int32 (-1 pads)}.
Anchors are drawn inside the pipeline by `random_map`, keyed on the record's index in the repeated, shuffled
stream: each epoch redraws them (the paper's recipe) and a restored iterator redraws exactly the same ones.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from data import pipeline
from data.pipeline import TokenizedRecords


def synthetic_records(n: int, *, seed: int, max_len: int, vocab_size: int, mask_token_id: int) -> TokenizedRecords:
    """n learnable fake conversations: each one of a few fixed token cycles at a random phase, 5% of tokens replaced
    by noise, the first quarter a prompt outside the loss mask, max_len/2..max_len tokens long. A block's tokens
    follow from its first token, so a working drafter + objective must drive the loss well below log(V) within a
    few dozen steps. They go through the same grain pipeline, padding and anchor sampler as real conversations."""
    cycles = np.random.default_rng(seed).choice(
        [v for v in range(min(vocab_size, 4096)) if v != mask_token_id], size=(4, 12), replace=False
    )
    examples = []
    for index in range(n):
        rng = np.random.default_rng((seed, index))
        length = int(rng.integers(max_len // 2, max_len + 1))
        prompt = int(rng.integers(2, max(3, length // 4)))
        cycle = cycles[rng.integers(0, len(cycles))]
        toks = cycle[(int(rng.integers(0, cycle.size)) + np.arange(length)) % cycle.size]
        noise = rng.random(length) < 0.05
        toks = np.where(noise, cycles.reshape(-1)[rng.integers(0, cycles.size, length)], toks)
        examples.append({"input_ids": toks.astype(np.int32), "loss_mask": np.arange(length) >= prompt})
    return TokenizedRecords.from_examples(examples, ids=[f"synthetic-{i}" for i in range(n)])


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
    made = synthetic_records(
        cfg.data.num_records,
        seed=cfg.seed,
        max_len=int(t.max_len),
        vocab_size=vocab_size,
        mask_token_id=mask_token_id,
    )
    return _record_batches(cfg, made, None, per_host_batch)


def _conversation_batches(cfg, tokenizer, per_host_batch: int):
    """Chat-templated conversations with assistant-only loss masks from data.pipeline (its own shuffle, host
    sharding, per-epoch anchors and exact-resume iterator)."""
    if tokenizer is None:
        raise ValueError("a conversation data source needs a tokenizer (data.tokenizer or a GGUF/HF target)")
    limit = cfg.data.limit
    records = pipeline.load_tokenized(cfg.data.source, tokenizer, cfg.train.max_len, limit=limit, skip=cfg.data.skip)
    return _record_batches(cfg, records, tokenizer, per_host_batch)


def _record_batches(cfg, records, tokenizer, per_host_batch: int):
    per_epoch = (len(records) // jax.process_count()) // per_host_batch
    ds = pipeline.build_dataset(
        records,
        tokenizer,
        cfg.train.max_len,
        per_host_batch,
        cfg.seed,
        num_epochs=cfg.train.epochs,
        num_anchors=cfg.num_anchors,
        block_size=cfg.block_size,
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
