"""Speculative decoding engine: prefill, then draft / verify / accept / commit rounds in one jitted while_loop.

One engine serves every proposer (DFlash, n-gram prompt lookup, none), so the plain baseline (proposer none,
K = 1) and a speculative run differ only in the proposer and K. Prefill and the decode loop are separate
jitted calls so that decode can be timed alone; the loop runs entirely on device and the host sees the
results once the whole batch has finished.

Positions, row b: the committed sequence is history[b, :n[b]]. Its last token, at `start = n - 1`, was
produced but has not been through the target yet, so the target cache and the drafter's context both hold
exactly the positions < start. A round runs the block [last, d_1 .. d_{K-1}] at positions start .. start+K-1.

Dimension letters: docs/glossary.md (one glossary for the repository). Here C = P + max_new_tokens + K.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from dflash_model.target import KVCache, config_of, forward
from infer.plain import pad_prompts, truncate_at_stop
from infer.proposers import NoProposer

# Trace counts of the jitted steps (incremented only while tracing): tests check one compile per shape bucket.
TRACES: collections.Counter = collections.Counter()


@flax.struct.dataclass
class DecodeState:
    history: jax.Array  # [B, C] committed tokens (prompt, then generated); beyond n[b] scratch
    prompt_len: jax.Array  # [B]
    n: jax.Array  # [B] committed tokens (prompt + generated)
    done: jax.Array  # [B] bool: stop token committed or max_new_tokens reached
    stop_ids: jax.Array  # [Y] ids that end a row, padded with -1 (data, not static: one compile for any set)
    cache: KVCache  # target K/V of positions < n - 1
    draft: Any  # proposer state (DFlash: its context cache, also of positions < n - 1)
    key: jax.Array  # sampling key (unused at temperature 0)
    rounds: jax.Array  # [] verify rounds run so far
    accept: jax.Array  # [B, I] tokens committed by each verify round, bonus included (0 = row was done)
    proposals: jax.Array  # [B, I, K-1] the drafts of each round
    nonfinite: jax.Array  # [] bool: some target logit was NaN or inf (its argmax, token 0, would be reported)


def accept_length(drafts_BK1, target_BK):
    """Accepted drafts a in [0, K-1]: the longest prefix where d_j == target token j-1.

    target_BK[:, j] is the target's token for position start+j+1 given the block prefix up to j, so draft
    d_{j+1} (drafts[:, j]) is right iff it equals target[:, j]; a = sum_j prod_{i<=j} [d_{i+1} == target_i].
    """
    return jnp.sum(jnp.cumprod(drafts_BK1 == target_BK[:, :-1], axis=1), axis=1).astype(jnp.int32)


def _pick(logits_BxV, temperature: float, key):
    """The target's token: argmax, or a sample from softmax(logits / T)."""
    if temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits_BxV / temperature, axis=-1).astype(jnp.int32)


def _is_stop(tokens, stop_Y):
    return jnp.any(tokens[..., None] == stop_Y, axis=-1)


def _round(target, proposer, params, st: DecodeState, *, k, temperature, max_new) -> DecodeState:
    """One draft -> verify -> accept -> commit round for every row (finished rows run along, change nothing)."""
    b = st.n.shape[0]
    start = st.n - 1
    last = jnp.take_along_axis(st.history, start[:, None], axis=1)[:, 0]
    drafts = proposer.propose(params, target, st.draft, st.history, st.n, k)  # [B, K-1]

    # Verify: one target forward over the block from the cache at `start` (its lengths == start).
    out = forward(target, jnp.concatenate([last[:, None], drafts], axis=1), st.cache, layer_ids=proposer.layer_ids)
    # target_tok[:, j] ~ p(x_{start+j+1} | committed, d_1..d_j). Greedy: argmax. T > 0: an independent sample
    # per position; drafts stay greedy, so accepting d_{j+1} iff it equals the sample is rejection sampling
    # with a one-hot proposal (accept w.p. p(d), else a sample from p restricted to x != d): lossless.
    target_tok = _pick(out.logits, temperature, jax.random.fold_in(st.key, st.rounds))
    a = accept_length(drafts, target_tok)

    # Commit target_tok[:, :a+1]: the first a equal the accepted drafts, target_tok[:, a] is the bonus (the
    # target's own token at the first mismatch, or after all K-1 drafts). Cut after a committed stop token.
    j = jnp.arange(k)
    stop_hit = _is_stop(target_tok, st.stop_ids) & (j[None, :] <= a[:, None])
    first_stop = jnp.min(jnp.where(stop_hit, j[None, :], k), axis=1)
    # Also cut at max_new: it keeps n <= P + max_new, so the K-wide writes below stay inside the capacity.
    room = max_new - (st.n - st.prompt_len)
    num_new = jnp.where(st.done, 0, jnp.minimum(jnp.minimum(a + 1, first_stop + 1), room))
    history = jax.vmap(lambda h, t, s: jax.lax.dynamic_update_slice(h, t, (s,)))(st.history, target_tok, st.n)
    n = st.n + num_new

    # Roll both caches back to the committed length n - 1: the target drops the K/V of rejected drafts; the
    # drafter gets the features of exactly the num_new committed positions start .. start+num_new-1.
    cache = out.cache.crop(n - 1)
    draft = proposer.observe(params, st.draft, out.features, num_new)

    done = st.done | jnp.any(stop_hit, axis=1) | (n - st.prompt_len >= max_new)
    return st.replace(
        history=history,
        n=n,
        done=done,
        cache=cache,
        draft=draft,
        rounds=st.rounds + 1,
        accept=st.accept.at[:, st.rounds].set(jnp.where(st.done, 0, a + 1)),
        proposals=st.proposals.at[jnp.arange(b), st.rounds].set(drafts),
        nonfinite=st.nonfinite | ~jnp.all(jnp.isfinite(out.logits)),
    )


def _prefill_impl(target, proposer, params, ids_BP, lengths_B, key, stop_Y, *, k, temperature, max_new):
    TRACES["prefill"] += 1
    b, p = ids_BP.shape
    capacity = p + max_new + k
    out = forward(
        target,
        ids_BP,
        KVCache.init(config_of(target), b, capacity),
        layer_ids=proposer.layer_ids,
        logits_at=lengths_B - 1,
    )
    key, sub = jax.random.split(key)
    first = _pick(out.logits, temperature, sub)
    rows = jnp.arange(b)
    history = jnp.zeros((b, capacity), jnp.int32).at[:, :p].set(ids_BP).at[rows, lengths_B].set(first)
    draft = proposer.observe(params, proposer.init(params, b, capacity), out.features, lengths_B)
    rounds = max(max_new - 1, 1)  # each round commits >= 1 token and the prefill gave the first
    return DecodeState(
        history=history,
        prompt_len=lengths_B,
        n=lengths_B + 1,
        done=_is_stop(first, stop_Y) | (max_new <= 1),
        stop_ids=stop_Y,
        cache=out.cache.crop(lengths_B),
        draft=draft,
        key=key,
        rounds=jnp.int32(0),
        accept=jnp.zeros((b, rounds), jnp.int32),
        proposals=jnp.zeros((b, rounds, k - 1), jnp.int32),
        nonfinite=~jnp.all(jnp.isfinite(out.logits)),
    )


def _decode_impl(target, proposer, params, st, *, k, temperature, max_new):
    TRACES["decode"] += 1
    step = functools.partial(_round, target, proposer, params, k=k, temperature=temperature, max_new=max_new)
    max_rounds = st.accept.shape[1]
    return jax.lax.while_loop(lambda s: (s.rounds < max_rounds) & ~jnp.all(s.done), step, st)


# Modules (target, DFlash drafter) are jit arguments as pytrees: their GraphDefs cannot be static arguments
# because Tunix's ModelConfig, held in them, is unhashable.
_STATIC = ("proposer", "k", "temperature", "max_new")
_prefill = jax.jit(_prefill_impl, static_argnames=_STATIC)
_decode = jax.jit(_decode_impl, static_argnames=_STATIC, donate_argnames=("st",))


@dataclasses.dataclass
class Generation:
    tokens: list[int]  # generated ids after the prompt, cut after the first stop id and at max_new_tokens
    accept_lengths: list[int]  # committed tokens per verify round, bonus included (before that cut)
    proposals: list[list[int]]  # the K-1 drafted ids of each round


class Engine:
    """A target + proposer + block size: `generate(prompts)`, or `prefill` and `decode` separately (timing)."""

    def __init__(
        self,
        target,
        proposer=None,
        params=None,
        *,
        block_size: int = 1,
        max_new_tokens: int,
        temperature: float = 0.0,
        stop_ids=(),
    ):
        proposer = proposer or NoProposer()
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        if isinstance(proposer, NoProposer) and block_size != 1:
            raise ValueError("without a proposer the block size is 1 (plain decoding)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.target = target
        self.proposer, self.params = proposer, params
        self.static = dict(k=int(block_size), temperature=float(temperature), max_new=int(max_new_tokens))
        self.stop_ids = tuple(sorted({int(s) for s in stop_ids}))
        slots = 8 * max(1, -(-len(self.stop_ids) // 8))  # a few fixed sizes: the set is data, not a shape
        self.stop_Y = jnp.asarray(list(self.stop_ids) + [-1] * (slots - len(self.stop_ids)), jnp.int32)

    @property
    def block_size(self) -> int:
        return self.static["k"]

    def prefill(self, ids_BP, lengths_B, key) -> DecodeState:
        return _prefill(self.target, self.proposer, self.params, ids_BP, lengths_B, key, self.stop_Y, **self.static)

    def decode(self, state: DecodeState) -> DecodeState:
        """The whole decode loop on device (the state's buffers are donated: do not reuse `state`)."""
        return _decode(self.target, self.proposer, self.params, state, **self.static)

    def inputs(self, prompts: list[list[int]], seed: int = 0):
        """Device arrays (ids [B, bucket], lengths [B], key) for `prefill`."""
        ids, lengths = pad_prompts(prompts)
        return jnp.asarray(ids), jnp.asarray(lengths), jax.random.key(seed)

    def results(self, state: DecodeState) -> list[Generation]:
        history, plen, n, accept, proposals, nonfinite = jax.device_get(
            (state.history, state.prompt_len, state.n, state.accept, state.proposals, state.nonfinite)
        )
        if nonfinite:
            # Target and drafter would both "agree" on argmax(NaN) = 0: a perfect tau for garbage.
            raise FloatingPointError(
                "the target produced NaN/inf logits while decoding (overflow in its dtype, or "
                "damaged weights): the tokens would be argmax(NaN) = 0; nothing is reported"
            )
        out = []
        for b in range(history.shape[0]):
            tokens = history[b, plen[b] : n[b]].tolist()
            rounds = int(np.count_nonzero(accept[b]))
            out.append(
                Generation(
                    truncate_at_stop(tokens, self.stop_ids), accept[b, :rounds].tolist(), proposals[b, :rounds].tolist()
                )
            )
        return out

    def generate(self, prompts: list[list[int]], seed: int = 0) -> list[Generation]:
        return self.results(self.decode(self.prefill(*self.inputs(prompts, seed))))
