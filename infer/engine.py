"""The speculative decoding engine: a target, a proposer and a block size, with `generate(prompts)` (or `prefill`
and `decode` apart, for timing) over infer/spec.py's jitted prefill and decode loop.

The engine checks its sizes before anything compiles, chooses the round strategy (the fixed block, an adaptive
width, a draft tree), and measures the costs an adaptive width or a tree size is chosen by (`calibrate`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from dflash_model.target import config_of
from infer.adaptive import verify_width
from infer.plain import pad_prompts, truncate_at_stop
from infer.proposers import DraftsTop, GrowsTree, NoProposer, Scores, WrapsDrafter
from infer.spec import (
    MAX_BLOCK,
    MAX_TREE_NODES,
    DecodePlan,
    DecodeState,
    _decode,
    _prefill,
    check_positions,
    verify_block,
    verify_forward,
)
from infer.tree_round import verify_tree
from infer.width_choice import default_widths, initial_state


# after prefill). Each runs `reps` times inside one jitted fori_loop, its cache carried and written in place as in
# the decode loop (a standalone call would copy the cache and pay the Python dispatch of every module leaf, both
# absent from a round); `_loop_ms` takes the difference of two repetition counts, which cancels the per-call cost.
@functools.partial(jax.jit, static_argnames=("proposer", "width", "k"))
def _probe_verify(target, proposer, st, reps, *, width, k):
    last = jnp.take_along_axis(st.history, (st.n - 1)[:, None], axis=1)[:, 0]
    drafts = jnp.zeros((st.n.shape[0], k - 1), jnp.int32)

    def body(_, carry):
        cache, acc = carry
        tok, a, _, grown, _ = verify_forward(
            target, proposer, st.replace(cache=cache), last, drafts, st.key, width=width, k=k, temperature=0.0
        )
        return grown.crop(st.cache.lengths), acc + jnp.sum(tok) + jnp.sum(a)

    return jax.lax.fori_loop(0, reps, body, (st.cache, jnp.int32(0)))[1]


@functools.partial(jax.jit, static_argnames=("proposer", "k", "nodes"))
def _probe_draft(target, proposer, params, st, reps, *, k, nodes=None):
    """A draft (a grown tree's, with `nodes`) repeated `reps` times in one loop."""

    def body(i, acc):
        # The last token varies with i so that the loop body cannot be hoisted out as loop-invariant.
        history = st.history.at[jnp.arange(st.n.shape[0]), st.n - 1].add(i)
        if nodes is not None and isinstance(proposer, GrowsTree):
            return acc + jnp.sum(proposer.propose_tree(params, target, st.draft, history, st.n, k, nodes)[1].token)
        return acc + jnp.sum(proposer.propose(params, target, st.draft, history, st.n, k))

    return jax.lax.fori_loop(0, reps, body, jnp.int32(0))


# id(target) -> (weakref to it, {(batch, capacity rounded up to 64, dtype, width): verify ms}): `Engine.calibrate`.
_VERIFY_MS: dict[int, tuple] = {}


def _loop_ms(fn, reps: int) -> float:
    """ms per repetition of fn(r) (r repetitions in one call): (time(1 + reps) - time(1)) / reps, each the fastest
    of three calls after a compile run; while that difference is not positive, up to twice more with 4x the reps
    (0 only when all three tries drown in noise). The fastest, not the median: other work on the CPU only ever
    adds time, and a burst of it during calibration would steer every round of the decode that follows (a
    calibration taken while a test ran beside it timed a width-2 verify at 36 ms, 19 ms on the quiet machine)."""

    def once(r):
        t = time.perf_counter()
        jax.block_until_ready(fn(r))
        return time.perf_counter() - t

    jax.block_until_ready(fn(1))  # compile (the count is data: one executable for every r)
    for _ in range(3):
        one = min(once(1) for _ in range(3))
        many = min(once(1 + reps) for _ in range(3))
        if many > one:
            break
        reps *= 4  # the machine's noise swallowed `reps` repetitions (a tiny model on a loaded CPU): time more
    return 1e3 * max(many - one, 0.0) / reps


@dataclasses.dataclass
class Generation:
    tokens: list[int]  # generated ids after the prompt, cut after the first stop id and at max_new_tokens
    accept_lengths: list[int]  # tokens each verify round committed (accepted drafts + the bonus, cut at a stop
    # token and at max_new_tokens): they sum to len(tokens) - 1, the first token being the prefill's
    proposals: list[list[int]]  # the K-1 drafted ids of each round
    verify_widths: list[int] = dataclasses.field(default_factory=list)  # tokens verified by each round
    drafted: list[bool] = dataclasses.field(default_factory=list)  # whether each round ran a drafter forward
    # accepted drafts + 1 before the cuts: what z-lab's benchmark counts (a last round may overrun the budget)
    accept_lengths_uncut: list[int] = dataclasses.field(default_factory=list)


def checked_tree_prior(prior) -> dict[int, float]:
    """{tree size: expected committed tokens per round} as ints and floats, or ValueError where a size is below 1
    or a value is not finite and positive (NaN and Infinity parse from JSON)."""
    prior = {int(n): float(t) for n, t in prior.items()}
    if not prior or min(prior) < 1 or not all(0 < t < math.inf for t in prior.values()):
        raise ValueError(f"tree_prior needs sizes >= 1 with expected tokens per round > 0 and finite, got {prior}")
    return prior


def _check_tree_prior(proposer, tree_nodes, adaptive) -> None:
    if not isinstance(proposer, GrowsTree):
        raise ValueError(
            "a tree size chosen at start-up (tree_prior) needs a proposer that grows its own tree (a lookup "
            f"tree), not {proposer.name}"
        )
    if tree_nodes is not None or adaptive:
        raise ValueError("tree_prior chooses the tree size: give it without tree_nodes and adaptive")


def _check_scalars(proposer, block_size, max_new_tokens, temperature) -> None:
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size}")
    if isinstance(proposer, NoProposer) and block_size != 1:
        raise ValueError("without a proposer the block size is 1 (plain decoding)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")


def _tree_shape(proposer, k, widths, tree_nodes, tree_top) -> tuple[int, int] | None:
    """(nodes, top) of a tree round, checked against the proposer and the adaptive widths; None for a chain."""
    if tree_nodes is None and isinstance(proposer, GrowsTree) and not isinstance(proposer, Scores):
        raise ValueError(f"the {proposer.name} proposer drafts trees only: give tree_nodes")
    if tree_nodes is None:
        return None
    if widths is not None and not isinstance(proposer, GrowsTree):
        raise ValueError(
            "a DDTree sets its own width (its nodes): tree_nodes and adaptive exclude each other; an "
            "adaptive tree needs a proposer that scores its nodes (propose_tree)"
        )
    if widths is not None and widths[-1] > tree_nodes + 1:
        raise ValueError(f"adaptive tree widths must be at most its nodes + 1 = {tree_nodes + 1}, got {widths}")
    if not isinstance(proposer, (DraftsTop, GrowsTree)):
        raise ValueError(
            f"a draft tree needs per-position distributions or a tree; the {proposer.name} proposer has neither"
        )
    if not (tree_nodes >= 1 and tree_top >= 1 and k >= 2):
        raise ValueError(
            f"a draft tree needs tree_nodes >= 1, tree_top >= 1, K >= 2; got {tree_nodes}, {tree_top}, {k}"
        )
    return int(tree_nodes), int(tree_top)


class Engine:
    """A target + proposer + block size: `generate(prompts)`, or `prefill` and `decode` separately (timing).

    adaptive: verify only the first w tokens of each round's block, w in `widths` (default `default_widths(K)`)
    chosen per round by `choose_width` from the costs `calibrate` measures at the decode's own shapes (`generate`
    calibrates on its first call; call it yourself before `prefill` to time decode alone). tree_prior {nodes:
    expected committed tokens per round}: a grown tree's size is chosen by `calibrate` among these, from the same
    measured costs.
    """

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
        adaptive: bool = False,
        widths: tuple[int, ...] | None = None,
        tree_nodes: int | None = None,
        tree_top: int = 4,
        tree_prior: dict[int, float] | None = None,
    ):
        proposer = proposer or NoProposer()
        if tree_prior is not None:
            # The tree size is chosen by `calibrate` among the prior's; until then the engine is the largest's.
            tree_prior = checked_tree_prior(tree_prior)
            _check_tree_prior(proposer, tree_nodes, adaptive)
            tree_nodes = max(tree_prior)
            block_size = tree_nodes + 1  # a grown tree's paths are at most block_size - 1 deep
        self.tree_prior = tree_prior
        _check_scalars(proposer, block_size, max_new_tokens, temperature)
        self.target = target
        self.proposer, self.params = proposer, params
        k = int(block_size)
        if widths is not None and not adaptive:
            raise ValueError("widths are the candidates of an adaptive engine: pass adaptive=True with them")
        if adaptive:
            widths = tuple(sorted({int(w) for w in (widths or default_widths(k))}))
            if not 1 <= widths[0] <= widths[-1] <= k or len(widths) < 2:
                raise ValueError(
                    f"adaptive widths must be at least two values in 1..{k} (the block size), got {widths}"
                )
        tree = _tree_shape(proposer, k, widths, tree_nodes, tree_top)
        verify = verify_tree if tree else verify_width if adaptive else verify_block
        self.plan = DecodePlan(
            k=k, max_new=int(max_new_tokens), temperature=float(temperature), widths=widths, tree=tree, verify=verify
        )
        self._check_sizes()
        # Costs (ms) of a verify at each candidate width and of the drafter's forward; `calibrate` measures them.
        self.costs: dict | None = None
        self.stop_ids = tuple(sorted({int(s) for s in stop_ids}))
        slots = 8 * max(1, -(-len(self.stop_ids) // 8))  # a few fixed sizes: the set is data, not a shape
        self.stop_Y = jnp.asarray(list(self.stop_ids) + [-1] * (slots - len(self.stop_ids)), jnp.int32)

    @property
    def block_size(self) -> int:
        return self.plan.k

    @property
    def width(self) -> int:
        """The widest verify a round runs: K, or a tree's nodes + 1 (what the cache holds beyond the tokens)."""
        return self.plan.width

    def _check_sizes(self) -> None:
        """K, a tree's nodes and a one-token prompt's decode against MAX_BLOCK, MAX_TREE_NODES and the target's
        positions, before anything compiles (`prefill` checks each prompt's own length)."""
        tree = self.plan.tree
        if self.block_size > MAX_BLOCK:
            raise ValueError(f"block size K={self.block_size} is more than {MAX_BLOCK}")
        if tree and tree[0] > MAX_TREE_NODES:
            raise ValueError(f"a draft tree of {tree[0]} nodes is more than {MAX_TREE_NODES}")
        positions = config_of(self.target).max_position_embeddings
        check_positions(1, self.plan.max_new, self.width, positions, "max_new_tokens")

    @property
    def widths(self) -> tuple[int, ...]:
        """The verify widths this engine may use: its candidates, the block size alone, or a tree's nodes."""
        if self.plan.widths:
            return self.plan.widths
        if self.plan.tree:
            return (self.plan.tree[0] + 1,)
        return (self.block_size,)

    @property
    def adaptive(self) -> bool:
        return self.plan.widths is not None

    @property
    def needs_costs(self) -> bool:
        """Whether this engine decodes by measured costs (an adaptive width, a tree size chosen at start-up)."""
        return self.adaptive or self.tree_prior is not None

    def prefill(self, ids_BP, lengths_B, key) -> DecodeState:
        if self.needs_costs and self.costs is None:
            raise RuntimeError(
                "an adaptive engine (or one choosing its tree size) decodes by measured costs: call calibrate() first"
            )
        return self._prefill(ids_BP, lengths_B, key, self.costs)

    def _prefill(self, ids_BP, lengths_B, key, costs) -> DecodeState:
        positions = config_of(self.target).max_position_embeddings
        check_positions(int(np.max(lengths_B)), self.plan.max_new, self.width, positions, "the longest prompt")
        strategy = None  # a fixed block, or a tree of fixed size: the round carries nothing of its own
        if self.plan.widths is not None:
            costs = costs or {"verify_ms": [0.0] * len(self.widths), "draft_ms": 0.0}  # `_measure`'s probes
            strategy = initial_state(self.plan.k, costs["verify_ms"], costs["draft_ms"])
        return _prefill(
            self.target,
            self.proposer,
            self.params,
            ids_BP,
            lengths_B,
            key,
            self.stop_Y,
            strategy,
            plan=self.plan,
        )

    def calibrate(self, ids_BP, lengths_B, key, reps: int = 10) -> dict:
        """Time, at these inputs' decode shapes, a verify forward at each width and the drafter's forward, each
        alone (`reps` repetitions in one call, see `_loop_ms`): {"widths", "verify_ms": [per width], "draft_ms"}.
        Attention runs over the whole cache capacity, so the shapes, not the prompt's length, set the cost.

        With a tree_prior, first choose the tree size: the one whose expected committed tokens per round (the prior)
        over its measured round cost (verify over its nodes + growing the tree) is the highest on this machine; the
        costs then carry the choice and every size's numbers ("tree_choice"). A state prefilled before a call is
        stale after it (its shapes are the old size's)."""
        if self.tree_prior is None:
            self.costs = self._measure(ids_BP, lengths_B, key, reps)
            return self.costs
        before, top = self.plan, self.plan.tree[1]
        measured, table, dearest = {}, {}, 0.0
        try:
            for n, tau in sorted(self.tree_prior.items()):
                self.plan = dataclasses.replace(self.plan, k=n + 1, tree=(n, top))
                measured[n] = c = self._measure(ids_BP, lengths_B, key, reps)
                # The rest of a round (the walk, commit, cache crop) is left out: 2-7% of a round in the measured
                # loop overheads, the same at every size, so leaving it out favours smaller trees by at most that.
                # A bigger tree never costs less: a measured dip is noise (each size is timed apart).
                dearest = max(dearest, c["verify_ms"][0] + c["draft_ms"], 1e-3)  # 1e-3: drowned in noise
                tps = round(1e3 * tau / dearest, 2)
                table[n] = {"tau": tau, "round_ms": round(dearest, 3), "tokens_per_s": tps}
        except BaseException:
            self.plan = before  # as it was: a failed choice leaves the engine's size and its costs unchanged
            raise
        best = max(table, key=lambda n: table[n]["tokens_per_s"])
        self.plan = dataclasses.replace(self.plan, k=best + 1, tree=(best, top))
        self.costs = {**measured[best], "tree_choice": {"nodes": best, "by_size": table}}
        return self.costs

    def _measure(self, ids_BP, lengths_B, key, reps: int) -> dict:
        st = self._prefill(ids_BP, lengths_B, key, None)  # the probes read shapes and caches, not costs
        k = self.block_size
        verify_ms = []
        for w in self.widths:
            # Measured once per target, width and cache shape in a process: every engine then chooses from the
            # same numbers (calibrations minutes apart differed by up to 1.5x on a busy machine).
            shape = (st.cache.k.shape[1], -(-st.cache.capacity // 64) * 64, str(st.cache.k.dtype), w)
            known = _VERIFY_MS.get(id(self.target))
            if known is None or known[0]() is not self.target:
                known = _VERIFY_MS[id(self.target)] = (weakref.ref(self.target), {})
            if shape not in known[1]:
                # A tree's verify is timed as a sequential one over as many tokens (the same matmuls, another mask).
                probe = lambda r, w=w: _probe_verify(self.target, self.proposer, st, r, width=w, k=max(k, w))
                known[1][shape] = _loop_ms(probe, reps)
            verify_ms.append(known[1][shape])
        # The cost of the model forward a round may pay: a hybrid's is its drafter's; a lookup is nearly free.
        model, params = (
            self.proposer.drafter(self.params)
            if isinstance(self.proposer, WrapsDrafter)
            else (self.proposer, self.params)
        )
        draft_ms = 0.0
        if k > 1:
            nodes = self.plan.tree[0] if self.plan.tree else None
            draft_ms = _loop_ms(lambda r: _probe_draft(self.target, model, params, st, r, k=k, nodes=nodes), reps)
        # A wider verify never costs less; a measured dip is noise, and would make the choice chase it.
        return {
            "widths": list(self.widths),
            "verify_ms": np.maximum.accumulate(verify_ms).tolist(),
            "verify_ms_measured": verify_ms,
            "draft_ms": draft_ms,
        }

    def decode(self, state: DecodeState) -> DecodeState:
        """The whole decode loop on device (the state's buffers are donated: do not reuse `state`)."""
        return _decode(self.target, self.proposer, self.params, state, plan=self.plan)

    def inputs(self, prompts: list[list[int]], seed: int = 0):
        """Device arrays (ids [B, bucket], lengths [B], key) for `prefill`."""
        ids, lengths = pad_prompts(prompts)
        return jnp.asarray(ids), jnp.asarray(lengths), jax.random.key(seed)

    def results(self, state: DecodeState) -> list[Generation]:
        history, plen, n, accept, uncut, proposals, widths, drafted, nonfinite = jax.device_get(
            (
                state.history,
                state.prompt_len,
                state.n,
                state.accept,
                state.uncut,
                state.proposals,
                state.widths,
                state.drafted,
                state.nonfinite,
            )
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
                    truncate_at_stop(tokens, self.stop_ids),
                    accept[b, :rounds].tolist(),
                    proposals[b, :rounds].tolist(),
                    widths[:rounds].tolist(),
                    drafted[:rounds].tolist(),
                    uncut[b, :rounds].tolist(),
                )
            )
        return out

    def generate(self, prompts: list[list[int]], seed: int = 0) -> list[Generation]:
        inputs = self.inputs(prompts, seed)
        if self.needs_costs and self.costs is None:
            self.calibrate(*inputs)
        return self.results(self.decode(self.prefill(*inputs)))
