"""Speculative decoding core: the decode state, the acceptance rule and one draft -> verify -> accept -> commit round,
run in a jitted while_loop after a jitted prefill.

One engine (infer/engine.py) serves every proposer (DFlash, n-gram prompt lookup, none), so the plain baseline
(proposer none, K = 1) and a speculative run differ only in the proposer and K. How a round verifies is its
strategy, a static argument: `verify_block` here (the whole block of K, every round), `infer.adaptive.verify_width`
(the first w of it, w chosen per round) or `infer.tree_round.verify_tree` (a draft tree). Prefill and the decode
loop are separate jitted calls so that decode can be timed alone; the loop runs entirely on device and the host
sees the results once the whole batch has finished.

Positions, row b: the committed sequence is history[b, :n[b]]. Its last token, at `start = n - 1`, was
produced but has not been through the target yet, so the target cache and the drafter's context both hold
exactly the positions < start. A round runs the block [last, d_1 .. d_{K-1}] at positions start .. start+K-1.

Dimension letters: docs/glossary.md (one glossary for the repository). Here C = P + max_new_tokens + K.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax
import jax
import jax.numpy as jnp

from dflash_model.target import KVCache, config_of, forward
from infer.proposers import Proposal, scored

# Trace counts of the jitted steps (incremented only while tracing): tests check one compile per shape bucket.
TRACES: collections.Counter = collections.Counter()

# The widest block K and the largest draft tree an engine accepts. A round's arrays grow with K (and a tree's
# attention with its nodes squared): K = 100000 compiled for minutes while memory grew. Both are bounded by the
# target's positions too (`check_positions`).
MAX_BLOCK = 1024
MAX_TREE_NODES = 1024


def check_positions(prompt_tokens: int, max_new_tokens: int, width: int, positions: int, name: str = "a prompt"):
    """Refuse a decode that would run past the target's positions: a prompt of P tokens, max_new_tokens more and a
    last verify of `width` tokens (K, or a tree's nodes + 1) need P + max_new_tokens + width of them (the decode's
    cache, C = P + max_new_tokens + K). Past them RoPE runs on positions the model never saw: quietly wrong."""
    need = prompt_tokens + max_new_tokens + width
    if need > positions:
        raise ValueError(
            f"{name}: a prompt of {prompt_tokens} + {max_new_tokens} new tokens + a verify of {width} = {need} "
            f"positions, more than the target's {positions} (max_position_embeddings): shorten the prompt or lower "
            "--max-new-tokens"
        )


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
    accept: jax.Array  # [B, I] tokens each verify round committed: a + 1, cut at a stop token and the budget (0: done)
    uncut: jax.Array  # [B, I] a + 1 before those cuts (z-lab's count: a last round may count tokens never output)
    proposals: jax.Array  # [B, I, K-1] the drafts of each round
    widths: jax.Array  # [I] tokens verified by each round (the last token and widths - 1 drafts)
    drafted: jax.Array  # [I] bool: the round ran a drafter forward (the hybrid skips it when every row matched)
    strategy: Any  # the round strategy's own state (infer.width_choice.WidthState for chosen widths; else None)
    nonfinite: jax.Array  # [] bool: some target logit was NaN or inf (its argmax, token 0, would be reported)


def accept_length(drafts_BK1, target_BK):
    """Accepted drafts a in [0, K-1]: the longest prefix where d_j == target token j-1.

    target_BK[:, j] is the target's token for position start+j+1 given the block prefix up to j, so draft
    d_{j+1} (drafts[:, j]) is right iff it equals target[:, j]; a = sum_j prod_{i<=j} [d_{i+1} == target_i].
    """
    return jnp.sum(jnp.cumprod(drafts_BK1 == target_BK[:, :-1], axis=1), axis=1).astype(jnp.int32)


def pick(logits_BxV, temperature: float, key):
    """The target's token: argmax, or a sample from softmax(logits / T)."""
    if temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits_BxV / temperature, axis=-1).astype(jnp.int32)


def is_stop(tokens, stop_Y):
    return jnp.any(tokens[..., None] == stop_Y, axis=-1)


@jax.named_scope("verify")
def verify_forward(target, proposer, st: DecodeState, last_B, drafts_BJ, key, *, width, k, temperature, branch=False):
    """Target forward over [last, d_1 .. d_{width-1}] from the cache at `start`; the target's tokens and the layer
    features padded to K (so every width returns one shape), the accepted count, the grown cache.

    branch (a width of the adaptive round's `lax.switch`): the cache is only read, and the new positions' K/V,
    padded to K, come back instead of it, for `KVCache.append` after the switch. A cache written inside a branch
    is copied whole, several times, by XLA:CPU; outside a switch the forward's own write is the one in place
    (appending after an unswitched forward made XLA copy the cache too: docs/results/decoding/cache-write/)."""
    out = forward(
        target,
        jnp.concatenate([last_B[:, None], drafts_BJ[:, : width - 1]], axis=1),
        st.cache,
        layer_ids=proposer.layer_ids,
        write_cache=not branch,
    )
    # target_tok[:, j] ~ p(x_{start+j+1} | committed, d_1..d_j). Greedy: argmax. T > 0: an independent sample
    # per position; drafts stay greedy, so accepting d_{j+1} iff it equals the sample is rejection sampling
    # with a one-hot proposal (accept w.p. p(d), else a sample from p restricted to x != d): lossless.
    TRACES[f"verify@{width}"] += 1
    target_tok = pick(out.logits, temperature, key)
    a = accept_length(drafts_BJ[:, : width - 1], target_tok)
    target_tok, feats, new_kv = pad_positions(k, target_tok, out.features, out.new_kv if branch else None)
    nonfinite = ~jnp.all(jnp.isfinite(out.logits))
    return target_tok, a, feats, (new_kv if branch else out.cache), nonfinite


def pad_positions(size, tok_BT, feats_BTF, new_kv):
    """A verify's per-position outputs (tokens [B, T], features [B, T, F] or None, new K/V [L, B, T, G, H] or None)
    padded to `size` positions, so every branch of a width switch returns one shape."""
    pad = size - tok_BT.shape[1]
    tok = jnp.pad(tok_BT, ((0, 0), (0, pad)))
    feats = None if feats_BTF is None else jnp.pad(feats_BTF, ((0, 0), (0, pad), (0, 0)))
    kv = None if new_kv is None else tuple(jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0))) for x in new_kv)
    return tok, feats, kv


class Verified(NamedTuple):
    """What a round's verify strategy returns: the proposal, the target's tokens at the verified positions padded
    to K ([B, K]), the accepted drafts a ([B]), the committed positions' features, the grown target cache, whether
    a logit was not finite, the tokens verified this round (the last token and width - 1 drafts), and the
    strategy's own state after the round (what it learns from a round stays with it: the fixed block has none)."""

    prop: Proposal
    target_tok: jax.Array
    accepted: jax.Array
    feats: Any
    cache: KVCache
    nonfinite: jax.Array
    width: jax.Array
    strategy: Any


def verify_block(target, proposer, params, st: DecodeState, last_B, key, plan: DecodePlan) -> Verified:
    """The fixed-block strategy: draft K-1 tokens, verify all of them."""
    k = plan.k
    prop = scored(proposer, params, target, st.draft, st.history, st.n, k)
    tok, a, feats, cache, nonfinite = verify_forward(
        target, proposer, st, last_B, prop.tokens, key, width=k, k=k, temperature=plan.temperature
    )
    return Verified(prop, tok, a, feats, cache, nonfinite, jnp.int32(k), st.strategy)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """What a decode is, fixed when it compiles: a jit static argument, so one compile per plan and prompt bucket.

    k: the block size K; max_new: new tokens at most; temperature: the target's sampling temperature (0: greedy);
    widths: an adaptive round's candidate verify widths (None: every round verifies the whole block); tree:
    (nodes, top) of a draft tree (None: no tree); verify: the round's strategy, a function (target, proposer,
    params, state, last token, key, plan) -> Verified: `verify_block`, `infer.adaptive.verify_width` or
    `infer.tree_round.verify_tree`."""

    k: int
    max_new: int
    temperature: float = 0.0
    widths: tuple[int, ...] | None = None
    tree: tuple[int, int] | None = None
    verify: Callable = verify_block

    @property
    def width(self) -> int:
        """The widest verify a round runs: K, or a tree's nodes + 1 (what the cache holds beyond the tokens)."""
        return max(self.k, self.tree[0] + 1 if self.tree else 0)


def _round(target, proposer, params, st: DecodeState, plan: DecodePlan) -> DecodeState:
    """One draft -> verify -> accept -> commit round for every row (finished rows run along, change nothing).

    With K-1 drafts d_1..d_{K-1} and the target's tokens t_0..t_{K-1} at the block's positions (t_j given the
    committed text and d_1..d_j), the round accepts a = max{j : d_i = t_{i-1} for all i <= j} drafts and commits
    t_0..t_a: the a accepted drafts and one bonus token, so every round commits 1 <= a + 1 <= K tokens and the
    text is the target's own (greedy: token for token; T > 0: in distribution, see `verify_forward`)."""
    b = st.n.shape[0]
    start = st.n - 1
    last = jnp.take_along_axis(st.history, start[:, None], axis=1)[:, 0]
    key = jax.random.fold_in(st.key, st.rounds)
    k, max_new = plan.k, plan.max_new
    v = plan.verify(target, proposer, params, st, last, key, plan)
    a, target_tok = v.accepted, v.target_tok

    # Commit target_tok[:, :a+1]: the first a equal the accepted drafts, target_tok[:, a] is the bonus (the
    # target's own token at the first mismatch, or after all verified drafts). Cut after a committed stop token.
    j = jnp.arange(k)
    stop_hit = is_stop(target_tok, st.stop_ids) & (j[None, :] <= a[:, None])
    first_stop = jnp.min(jnp.where(stop_hit, j[None, :], k), axis=1)
    # Also cut at max_new: it keeps n <= P + max_new, so the K-wide writes below stay inside the capacity.
    room = max_new - (st.n - st.prompt_len)
    num_new = jnp.where(st.done, 0, jnp.minimum(jnp.minimum(a + 1, first_stop + 1), room))
    history = jax.vmap(lambda h, t, s: jax.lax.dynamic_update_slice(h, t, (s,)))(st.history, target_tok, st.n)
    n = st.n + num_new

    # Roll both caches back to the committed length n - 1: the target drops the K/V of rejected drafts; the
    # drafter gets the features of exactly the num_new committed positions start .. start+num_new-1.
    cache = v.cache.crop(n - 1)
    draft = proposer.observe(params, st.draft, v.feats, num_new)

    done = st.done | jnp.any(stop_hit, axis=1) | (n - st.prompt_len >= max_new)
    return st.replace(
        history=history,
        n=n,
        done=done,
        cache=cache,
        draft=draft,
        rounds=st.rounds + 1,
        accept=st.accept.at[:, st.rounds].set(num_new),
        uncut=st.uncut.at[:, st.rounds].set(jnp.where(st.done, 0, a + 1)),
        # a tree round records its likeliest chain (DDTree: the drafter's greedy block)
        proposals=st.proposals.at[jnp.arange(b), st.rounds].set(v.prop.tokens),
        widths=st.widths.at[st.rounds].set(v.width),
        drafted=st.drafted.at[st.rounds].set(v.prop.drafted),
        strategy=v.strategy,
        nonfinite=st.nonfinite | v.nonfinite,
    )


def _prefill_impl(
    target,
    proposer,
    params,
    ids_BP,
    lengths_B,
    key,
    stop_Y,
    strategy,
    plan: DecodePlan,
):
    TRACES["prefill"] += 1
    b, p = ids_BP.shape
    k, max_new = plan.k, plan.max_new
    capacity = p + max_new + plan.width  # a verify writes K (or a tree's nodes) slots
    out = forward(
        target,
        ids_BP,
        KVCache.init(config_of(target), b, capacity),
        layer_ids=proposer.layer_ids,
        logits_at=lengths_B - 1,
    )
    key, sub = jax.random.split(key)
    first = pick(out.logits, plan.temperature, sub)
    rows = jnp.arange(b)
    history = jnp.zeros((b, capacity), jnp.int32).at[:, :p].set(ids_BP).at[rows, lengths_B].set(first)
    draft = proposer.observe(params, proposer.init(params, b, capacity), out.features, lengths_B)
    rounds = max(max_new - 1, 1)  # each round commits >= 1 token and the prefill gave the first
    return DecodeState(
        history=history,
        prompt_len=lengths_B,
        n=lengths_B + 1,
        done=is_stop(first, stop_Y) | (max_new <= 1),
        stop_ids=stop_Y,
        cache=out.cache.crop(lengths_B),
        draft=draft,
        key=key,
        rounds=jnp.int32(0),
        accept=jnp.zeros((b, rounds), jnp.int32),
        uncut=jnp.zeros((b, rounds), jnp.int32),
        proposals=jnp.zeros((b, rounds, k - 1), jnp.int32),
        widths=jnp.zeros((rounds,), jnp.int32),
        drafted=jnp.zeros((rounds,), bool),
        strategy=strategy,
        nonfinite=~jnp.all(jnp.isfinite(out.logits)),
    )


def _decode_impl(target, proposer, params, st, plan: DecodePlan):
    TRACES["decode"] += 1
    step = functools.partial(_round, target, proposer, params, plan=plan)
    max_rounds = st.accept.shape[1]
    return jax.lax.while_loop(lambda s: (s.rounds < max_rounds) & ~jnp.all(s.done), step, st)


# Modules (target, DFlash drafter) are jit arguments as pytrees: their GraphDefs cannot be static arguments
# because Tunix's ModelConfig, held in them, is unhashable.
_STATIC = ("proposer", "plan")
_prefill = jax.jit(_prefill_impl, static_argnames=_STATIC)
_decode = jax.jit(_decode_impl, static_argnames=_STATIC, donate_argnames=("st",))
