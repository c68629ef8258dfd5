"""Training blocks whose anchors lie closer than K (some equal) must stay independent: a block may read target
features only before its anchor and its own input, or the drafter trains on features it will never have."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

from dflash_model.drafter import abstract_drafter, train_logits
from dflash_model.drafter_config import drafter_config_for
from dflash_model.target import build_target, randomize
from train.objective import default_gamma, dflash_loss

# (T, anchors of one row) per K: 3 apart with one anchor repeated, so every block overlaps every other, and
# a + K <= T as sample_anchors draws them.
CASES = {16: (36, [5, 8, 11, 11, 14]), 64: (96, [20, 23, 26, 26, 29])}
SAME = 1e-6  # a masked position contributes exactly 0; this only allows for reordered fp32 sums
MOVED = 1e-3  # a visible change moves these logits (about +-2.3) by 0.2 or more: far from both bounds
ROWS = 16  # every logits call of a K is padded to this many rows, so the K's tests share one compile
# XLA:CPU at backend optimisation level 0 compiles these programs in ~1.5 s instead of 4-5 s, most of this file's
# time; the masks under test are the same program at any level.
fast_jit = functools.partial(jax.jit, static_argnums=0, compiler_options={"xla_backend_optimization_level": 0})


@pytest.fixture(scope="module")
def run():
    """(logits(k, features, tokens, anchors), loss(k, features, tokens, loss_mask, anchors)): train_logits and
    dflash_loss of one tiny random target and drafter, jitted."""
    # randomize sets every parameter, so abstract modules give conftest.tiny_target's weights (and a randomized
    # build_drafter's) without first compiling an initialiser per parameter shape: 6-9 s of this CPU saved
    target = randomize(nnx.eval_shape(lambda: build_target(tiny_config("qwen3"))), seed=0)
    cfg = drafter_config_for(
        target.target_config, mask_token_id=511, num_layers=2, n_features=2, block_size=16, target_layer_ids=(0, 2)
    )
    # randomize, not build_drafter's init: non-unit norms and larger weights keep every dependence visible
    graph, state = nnx.split((target, randomize(abstract_drafter(cfg), seed=1)))

    @fast_jit
    def logits(k, state, features, tokens, anchors):
        target, drafter = nnx.merge(graph, state)
        return train_logits(drafter, target, features, tokens, anchors, k)

    @fast_jit
    def loss(k, state, features, tokens, loss_mask, anchors):
        target, drafter = nnx.merge(graph, state)
        return dflash_loss(drafter, target, features, tokens, loss_mask, anchors, block_size=k, gamma=default_gamma(k))

    return (lambda k, *args: logits(k, state, *args)), (lambda k, *args: loss(k, state, *args)[0])


def _row(k: int):
    """(features [T, F], tokens [T], anchors [N]) of one random row; the features need not be the target's."""
    t, anchors = CASES[k]
    rng = np.random.default_rng(k)
    features = rng.standard_normal((t, 2 * 64)).astype(np.float32)
    return features, rng.integers(0, 500, t).astype(np.int32), np.asarray(anchors, np.int32)


def _logits(run, features, tokens, anchors, k):
    """[R, N, K, V] for R rows; features [R|1, T, F], tokens [R|1, T], anchors [R, N]."""
    r = len(anchors)
    pad = max(ROWS - r, 0)

    def rows(x):
        x = np.broadcast_to(x, (r, *x.shape[1:]))
        return jnp.asarray(np.concatenate([x, np.repeat(x[:1], pad, axis=0)]))

    out = run[0](k, rows(features), rows(tokens), rows(anchors))
    return np.asarray(out)[:r]


def _diff(x, y) -> float:
    return float(np.max(np.abs(x - y)))


@pytest.mark.parametrize("k", sorted(CASES))
def test_features_at_and_after_the_anchor_are_invisible(run, k):
    """Row 1+n changes every feature at positions >= a_n, row 1+N+n only the one at a_n - 1: block n must ignore
    the first and follow the second, and every block anchored after a_n must follow the first."""
    features, tokens, anchors = _row(k)
    n_blocks, t = len(anchors), len(features)
    noise = 3.0 * np.random.default_rng(1).standard_normal(features.shape).astype(np.float32)
    pos = np.arange(t)[:, None]
    rows = [features]
    rows += [np.where(pos >= a, features + noise, features) for a in anchors]
    rows += [np.where(pos == a - 1, features + noise, features) for a in anchors]
    out = _logits(run, np.stack(rows), tokens[None], np.tile(anchors, (len(rows), 1)), k)
    for n, a in enumerate(anchors):
        kept = _diff(out[1 + n, n], out[0, n])
        assert kept <= SAME, f"K={k}: block {n} (anchor {a}) moved {kept:.3g} when the features >= {a} changed"
        seen = _diff(out[1 + n_blocks + n, n], out[0, n])
        assert seen > MOVED, f"K={k}: block {n} (anchor {a}) moved only {seen:.3g} when feature {a - 1} changed"
        for m, later in enumerate(anchors):
            if later > a:
                moved = _diff(out[1 + n, m], out[0, m])
                assert moved > MOVED, f"K={k}: block {m} (anchor {later}) moved only {moved:.3g} for features >= {a}"


@pytest.mark.parametrize("k", sorted(CASES))
def test_tokens_after_the_anchor_are_invisible(run, k):
    """Row 1+n replaces every token after a_n (the input of every block anchored later changes with them), row
    1+N+n the token at a_n, block n's own input: block n must ignore the first and follow the second."""
    features, tokens, anchors = _row(k)
    n_blocks, t = len(anchors), len(tokens)
    other = (tokens + 1 + np.random.default_rng(2).integers(0, 400, t)) % 500  # differs at every position
    rows = [tokens]
    rows += [np.where(np.arange(t) > a, other, tokens) for a in anchors]
    rows += [np.where(np.arange(t) == a, other, tokens) for a in anchors]
    out = _logits(run, features[None], np.stack(rows), np.tile(anchors, (len(rows), 1)), k)
    for n, a in enumerate(anchors):
        kept = _diff(out[1 + n, n], out[0, n])
        assert kept <= SAME, f"K={k}: block {n} (anchor {a}) moved {kept:.3g} when the tokens after {a} changed"
        seen = _diff(out[1 + n_blocks + n, n], out[0, n])
        assert seen > MOVED, f"K={k}: block {n} (anchor {a}) moved only {seen:.3g} when its own token changed"


@pytest.mark.parametrize("k", sorted(CASES))
def test_other_blocks_do_not_matter(run, k):
    """Block n's logits stay put whatever the other blocks of its row are: all moved onto its anchor, all one
    after it, all padding (-1), or removed (block n alone in a one-anchor row, a different compiled shape)."""
    features, tokens, anchors = _row(k)
    variants = {"on its anchor": lambda a: a, "one after it": lambda a: a + 1, "padding": lambda a: -1}
    rows, where = [anchors], []
    for n, a in enumerate(anchors):
        for name, move in variants.items():
            rows.append([a if m == n else move(a) for m in range(len(anchors))])
            where.append((n, name))
    out = _logits(run, features[None], tokens[None], np.asarray(rows), k)
    for (n, name), got in zip(where, out[1:]):
        moved = _diff(got[n], out[0, n])
        assert moved <= SAME, f"K={k}: block {n} (anchor {anchors[n]}) moved {moved:.3g} with the others {name}"
    alone = _logits(run, features[None], tokens[None], anchors[:, None], k)[:, 0]
    for n, a in enumerate(anchors):
        # another shape runs other matmul tilings: equal up to fp32 rounding, not bit for bit
        moved = _diff(alone[n], out[0, n])
        assert moved <= 1e-5, f"K={k}: block {n} (anchor {a}) alone differs by {moved:.3g} from in its row"


@pytest.mark.parametrize("k", sorted(CASES))
def test_loss_of_overlapping_blocks_equals_blocks_alone(run, k):
    """dflash_loss of the row, and of the row less any one block (made padding), equals the mean loss of its
    blocks each alone in a row (relative 1e-5). These N+1 equations fix every block's loss inside the row, so
    each equals its loss alone."""
    features, tokens, anchors = _row(k)
    t, n_blocks = len(tokens), len(anchors)
    # Every label of every block is inside the row and the loss mask, so all blocks weigh the same in the loss
    # and a plain mean is its weighted one.
    assert np.all(anchors + k <= t), f"K={k}: anchors {anchors} leave some block's labels past T={t}"
    args = jnp.asarray(features[None]), jnp.asarray(tokens[None]), jnp.asarray(np.ones((1, t), bool))

    def loss(row):
        return float(run[1](k, *args, jnp.asarray([row])))

    # A row of one block is padded as sample_anchors pads one (-1 last): every call then has one [1, N] shape and
    # one compile, and test_other_blocks_do_not_matter shows padding equals removal.
    alone = np.asarray([loss([a] + [-1] * (n_blocks - 1)) for a in anchors])
    for left_out in [None, *range(n_blocks)]:
        kept = [n for n in range(n_blocks) if n != left_out]
        got = loss([anchors[n] for n in kept] + [-1] * (n_blocks - len(kept)))
        want = float(np.mean(alone[kept]))
        assert abs(got - want) <= 1e-5 * want, (
            f"K={k}: row of blocks {kept} has loss {got:.6f}; its blocks alone give {want:.6f} (alone: {alone})"
        )
