"""Resolve the CLIs' --target and --draft arguments into a target module, tokenizer and proposer."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

from data.assets import smollm2_gguf
from dflash_model import drafter_weights
from dflash_model.config import PRESETS
from dflash_model.drafter import DRAFTER_PRESETS, build_drafter, drafter_config_for
from dflash_model.tokenizer import load_tokenizer
from dflash_model.weights import load_target, load_target_config
from infer import proposers
from infer.plain import PROMPT_BUCKETS
from infer.replies import load_index
from infer.spec import MAX_BLOCK, MAX_TREE_NODES, check_positions, checked_tree_prior

NGRAM_BLOCK = 8  # default K for prompt lookup: cheap drafts, and verify costs about the same up to here
TREE_NODES = 16  # default draft-tree size (nodes besides the root) of 'tree:DIR'
LOOKUP_TREE_NODES = 7  # default size of 'lookuptree:FILE' (a verify of 8)
TREE_PRIOR_FILE = "tree_tau.json"  # beside a reply file: a lookup tree's tokens per round by size ('lookuptreeauto:')


def at_least(low: int, high: int | None = None):
    """argparse type: an int >= low (a 0 or negative count is refused, not read as 'the default' or 'all'), and
    <= high where one is given."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is less than {low}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{value} is more than {high}")
        return value

    parse.__name__ = f"int >= {low}" if high is None else f"int in {low}..{high}"
    return parse


def non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text} is negative (or not a number)")
    return value


@dataclasses.dataclass
class Target:
    path: Path
    config: Any
    model: Any  # None until `load_weights` (load_target_spec(weights=False): the config and tokenizer only)
    tokenizer: Any  # None when the target directory ships none (then only --prompt-ids works)
    dtype: str | None = None

    def load_weights(self) -> Target:
        """Read the weights (a no-op once read): a CLI checks its inputs against the config first."""
        if self.model is None:
            self.config, self.model = load_target(self.path, dtype=self.dtype)
        return self


def load_target_spec(spec: str, dtype: str | None = None, *, weights: bool = True) -> Target:
    """'smollm2' (the package-shipped SmolLM2-135M GGUF), an HF model directory or a .gguf file. weights=False:
    its config and tokenizer only (`Target.load_weights` reads the rest)."""
    if spec == "smollm2":
        path = smollm2_gguf()
    else:
        path = Path(spec)
    cfg = load_target_config(path, dtype=dtype)
    try:
        tok = load_tokenizer(path)
    except (FileNotFoundError, OSError, ValueError):
        tok = None
    target = Target(path, cfg, None, tok, dtype)
    return target.load_weights() if weights else target


@dataclasses.dataclass
class Draft:
    name: str
    proposer: Any
    params: Any
    block_size: int  # the K to use (the drafter's trained K unless --block says otherwise)
    adaptive: bool = False  # verify a width chosen per round (infer.spec.choose_width), not always K
    tree_nodes: int | None = None  # verify a draft tree of this many nodes per round (infer.tree), not a chain
    # {tree size: expected committed tokens per round}: the engine chooses its tree size among these at start-up
    # from the costs it measures (infer.spec.Engine.calibrate)
    tree_prior: dict[int, float] | None = None

    @property
    def width(self) -> int:
        """The widest verify this draft runs (K, or a tree's nodes + 1): what a decode needs beyond its tokens."""
        return max(self.block_size, (self.tree_nodes or 0) + 1)

    def engine_options(self) -> dict:
        """The `infer.spec.Engine` keywords this draft decodes with."""
        if self.tree_prior is not None:
            return dict(tree_prior=self.tree_prior)
        return dict(block_size=self.block_size, adaptive=self.adaptive, tree_nodes=self.tree_nodes)


def tree_prior(replies_file: str) -> dict[int, float] | None:
    """{tree size: expected committed tokens per round} of a lookup tree over this reply file: its directory's
    TREE_PRIOR_FILE (written by `benchmarks/lookup_sim.py --prior-out`), or None where it has none."""
    path = Path(replies_file).parent / TREE_PRIOR_FILE
    if not path.is_file():
        return None
    try:
        return checked_tree_prior(json.loads(path.read_text())["tau"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: expected {{'tau': {{tree size: tokens per round}}}} ({e})") from e


def load_draft_spec(
    spec: str,
    target_cfg,
    block: int | None = None,
    seed: int = 0,
    *,
    dtype: str | None = None,
    zero_features: bool = False,
) -> Draft:
    """'none' (plain decoding), 'ngram' (prompt lookup), 'random' (untrained DFlash drafter preset for the
    target), a DFlash drafter directory, or 'hybrid:' + one of the last two (n-gram where it matches, else
    DFlash); 'replies:FILE' (prompt lookup where the context matches, else a reply file's n-grams:
    infer.replies), 'replies:FILE+DIR' (that where it is confident, else the drafter's block); 'adaptive:' before
    any but none verifies a width chosen per round. dtype: a directory's compute dtype (default: as saved);
    zero_features: the features.zero ablation (the drafter sees zeros instead of target features). 'tree:DIR' (or
    'treeN:DIR', N nodes; default TREE_NODES) verifies a draft tree built from the drafter's per-position
    distributions (DDTree) instead of its greedy block. 'lookuptreeN:FILE' verifies a tree of N nodes grown from
    prompt lookup and a reply file (proposers.LookupTreeProposer), 'lookuptree:FILE' of LOOKUP_TREE_NODES;
    'lookuptreeauto:FILE' one whose size the engine chooses at start-up from the file's TREE_PRIOR_FILE (tokens per
    round by size) and the round costs it measures;
    'adaptive:lookuptreeN:FILE' verifies its first w nodes, w chosen per round. A directory's draft_vocab.json (the
    draft vocabulary it was trained on) restricts its proposals to those tokens; 'fullvocab:DIR' ignores it."""

    def load_inner(inner_spec: str) -> Draft:  # the spec a prefix wraps, with this call's options
        return load_draft_spec(inner_spec, target_cfg, block, seed, dtype=dtype, zero_features=zero_features)

    if block is not None and not 1 <= block <= MAX_BLOCK:
        raise ValueError(f"--draft {spec!r}: block size K={block} is outside 1..{MAX_BLOCK}")
    lookup_tree = re.match(r"lookuptree(\d*|auto):(.*)", spec)
    if lookup_tree:
        return _lookup_tree_draft(spec, lookup_tree[1], _named(spec, lookup_tree[2], "a reply file"), target_cfg, block)
    tree = re.match(r"tree(\d*):(.*)", spec)
    if tree:
        nodes = _tree_nodes(spec, tree[1] or TREE_NODES)  # before the drafter loads
        inner = load_inner(_named(spec, tree[2], "a drafter directory (or random)"))
        if not hasattr(inner.proposer, "propose_top"):
            raise ValueError(f"--draft {spec!r}: a draft tree needs a DFlash drafter (a directory or random)")
        return dataclasses.replace(inner, name=f"tree{nodes}-{inner.name}", tree_nodes=nodes)
    prefix = re.match(r"(fullvocab|adaptive|hybrid|replies):", spec)
    if prefix and not spec[prefix.end() :]:
        what = "a reply file" if prefix[1] == "replies" else "a drafter spec (a directory, random, ...)"
        raise ValueError(f"--draft {spec!r}: {prefix[0]} needs {what} after the ':'")
    if spec.startswith("fullvocab:"):
        # The drafter over the whole vocabulary, ignoring its draft_vocab.json (what a z-lab server does).
        inner = load_inner(spec.split(":", 1)[1])
        if not isinstance(inner.proposer, proposers.DFlashProposer):
            raise ValueError(f"--draft {spec!r}: fullvocab: applies to a DFlash drafter directory")
        proposer = dataclasses.replace(inner.proposer, vocab=None)
        return dataclasses.replace(inner, name=f"fullvocab-{inner.name}", proposer=proposer)
    if spec.startswith("adaptive:"):
        inner = load_inner(spec.split(":", 1)[1])
        if inner.block_size < 2:
            raise ValueError(f"--draft {spec!r}: plain decoding has no width to choose")
        if inner.tree_prior is not None:
            raise ValueError(f"--draft {spec!r}: a tree size per run or a width per round, not both: lookuptreeN")
        return dataclasses.replace(inner, name=f"adaptive-{inner.name}", adaptive=True)
    if spec == "none":
        if block not in (None, 1):
            raise ValueError("--draft none decodes one token per step: --block must be 1 or left out")
        return Draft("none", proposers.NoProposer(), None, 1)
    if spec == "ngram":
        k = block or NGRAM_BLOCK
        return Draft("ngram", proposers.NGramProposer(), None, k)
    if spec.startswith("replies:"):
        # Prompt lookup where the context matches, the target's past replies elsewhere (infer.replies); with
        # "+DIR", this drafter's block where neither is confident (proposers.ReplyHybridProposer).
        # FILE ends at the last "+": a reply file's name may hold one, a drafter directory's name may not.
        rest = spec.split(":", 1)[1]
        file, plus, drafter_dir = rest.rpartition("+")
        if not plus:
            file, drafter_dir = rest, ""
        elif not drafter_dir:
            raise ValueError(f"--draft {spec!r}: replies:FILE+DIR needs a drafter directory after the '+'")
        index = load_index(file, target_cfg.vocab_size)
        if not drafter_dir:
            return Draft("replies", proposers.ReplyLookupProposer(), index, block or NGRAM_BLOCK)
        inner = load_inner(drafter_dir)
        if not isinstance(inner.proposer, proposers.DFlashProposer):
            raise ValueError(f"--draft {spec!r}: replies:FILE+DIR needs a DFlash drafter directory (or random)")
        proposer = proposers.ReplyHybridProposer(inner.proposer)
        return dataclasses.replace(inner, name="replies-hybrid", proposer=proposer, params=(inner.params, index))
    if spec.startswith("hybrid:"):
        # Prompt lookup where the context has a match, this drafter's block elsewhere (proposers.HybridProposer).
        inner = load_inner(spec.split(":", 1)[1])
        return dataclasses.replace(inner, name="hybrid", proposer=proposers.HybridProposer(inner.proposer))
    if spec == "random":
        cfg, drafter = random_drafter(target_cfg, seed=seed)
    else:
        if not Path(spec).is_dir():
            raise ValueError(
                f"--draft {spec!r}: expected none, ngram, random, a drafter directory, hybrid:DIR, replies:FILE "
                "or replies:FILE+DIR"
            )
        cfg, drafter = drafter_weights.load_drafter(spec, target_cfg, dtype=dtype)
        vocab = drafter_weights.load_draft_vocab(spec, cfg.vocab_size)
        return dflash_draft("dflash", drafter, cfg, block, zero_features=zero_features, vocab=vocab)
    return dflash_draft("random", drafter, cfg, block, zero_features=zero_features)


def _named(spec: str, rest: str, what: str) -> str:
    """The part of a --draft value after its prefix, refused when empty (Path('') is the current directory)."""
    if not rest:
        raise ValueError(f"--draft {spec!r}: needs {what} after the ':'")
    return rest


def _tree_nodes(spec: str, text) -> int:
    """A draft tree's size, from 1 to MAX_TREE_NODES."""
    nodes = int(text)
    if not 1 <= nodes <= MAX_TREE_NODES:
        raise ValueError(f"--draft {spec!r}: a draft tree of {nodes} nodes; give 1..{MAX_TREE_NODES}")
    return nodes


def _lookup_tree_draft(spec: str, size: str, replies_file: str, target_cfg, block: int | None) -> Draft:
    """A tree grown from prompt lookup and a reply file (proposers.LookupTreeProposer), as deep as it has nodes:
    `size` nodes, or 'auto' (chosen at start-up from the file's TREE_PRIOR_FILE). Sizes are checked before the
    reply file is read."""
    if block is not None:
        raise ValueError(f"--draft {spec!r}: a lookup tree's width is its nodes + 1; give lookuptreeN, not @K")
    prior = tree_prior(replies_file) if size == "auto" else None
    if size == "auto" and prior is None:
        raise ValueError(
            f"--draft {spec!r}: no {Path(replies_file).parent / TREE_PRIOR_FILE} to choose the size from "
            "(benchmarks/lookup_sim.py --prior-out writes it); give lookuptreeN:FILE"
        )
    nodes = _tree_nodes(spec, max(prior) if prior is not None else size or LOOKUP_TREE_NODES)
    lo, hi = proposers.LOOKUP_TREE_ORDERS
    index = load_index(replies_file, target_cfg.vocab_size, min_n=lo, max_n=hi)
    if prior is not None:
        return Draft("lookuptree-auto", proposers.LookupTreeProposer(), index, nodes + 1, tree_prior=prior)
    return Draft(f"lookuptree{nodes}", proposers.LookupTreeProposer(), index, nodes + 1, tree_nodes=nodes)


def dflash_draft(
    name: str, drafter, cfg, block: int | None = None, *, zero_features: bool = False, vocab=None
) -> Draft:
    """A DFlash drafter module as a Draft, at K = `block` (default: its trained K; 2..trained K allowed); `vocab`
    its draft vocabulary (token ids), if it was trained on one."""
    k = block or cfg.block_size
    if not 2 <= k <= cfg.block_size:
        raise ValueError(f"--block {k}: this drafter was trained with K={cfg.block_size}; use 2..{cfg.block_size}")
    proposer = proposers.DFlashProposer(cfg, zero_features=zero_features, vocab=vocab)
    return Draft(name, proposer, drafter, k)


_SHAPE_FIELDS = (
    "family",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def random_drafter(target_cfg, seed: int = 0):
    """An untrained drafter for `target_cfg`: the drafter preset made for that target when one exists (so the
    mask id is the one a trained drafter would use), else the paper's recipe sized to the target."""
    same = lambda t: all(getattr(t, f) == getattr(target_cfg, f) for f in _SHAPE_FIELDS)
    cfg = next((c for c, tname in DRAFTER_PRESETS.values() if same(PRESETS[tname])), None)
    if cfg is None:
        # No preset: the last vocabulary row as mask (an unknown target's free rows are unknown), and as many
        # of the recipe's 5 features as the default spread rule allows at this depth.
        print(f"no drafter preset for this target; using mask id {target_cfg.vocab_size - 1}", file=sys.stderr)
        for n in range(5, 0, -1):
            try:
                cfg = drafter_config_for(target_cfg, mask_token_id=target_cfg.vocab_size - 1, n_features=n)
                break
            except ValueError:
                continue
    cfg = cfg.replace(dtype=target_cfg.dtype)
    return cfg, build_drafter(cfg, seed=seed)


def check_prompt_ids(prompts: list[list[int]], target_cfg, names=None, where: str = "prompt") -> None:
    """Refuse token ids outside the target's vocabulary (an out-of-range id embeds as NaN or wraps, and target and
    drafter then agree on garbage: a perfect tau for nothing) and prompts that leave no room in its positions."""
    v, cap = target_cfg.vocab_size, target_cfg.max_position_embeddings
    for i, ids in enumerate(prompts):
        name = names[i] if names else f"{where} {i}"
        if not len(ids):
            raise ValueError(f"{name}: an empty prompt (a decode starts from at least one token)")
        bad = [t for t in ids if not 0 <= int(t) < v]
        if bad:
            raise ValueError(
                f"{name}: token id {bad[0]} is outside the target's vocabulary 0..{v - 1} "
                f"(vocab_size {v}){f'; {len(bad)} such ids' if len(bad) > 1 else ''}"
            )
        if len(ids) >= cap:
            raise ValueError(f"{name}: {len(ids)} prompt tokens leave no room in the target's {cap} positions")


def fit_prompts(
    prompts: list[list[int]], target_cfg, *, max_new_tokens: int, width: int, names: list[str], truncate: bool = False
) -> tuple[list[list[int]], dict[str, list[int]]]:
    """Each prompt checked to fit the target's positions with max_new_tokens and a verify of `width` tokens
    (`infer.spec.check_positions`) and the largest prompt bucket, before anything compiles: one that does not is
    refused with the numbers, or with truncate, cut to its last tokens that fit (the chat template's generation
    prompt is at the end) and said on stderr. Returns (prompts, {name: [tokens before, after]} of those cut)."""
    positions = target_cfg.max_position_embeddings
    check_positions(1, max_new_tokens, width, positions, "--max-new-tokens")
    room = min(positions - max_new_tokens - width, PROMPT_BUCKETS[-1])
    out, cut = [], {}
    for name, ids in zip(names, prompts, strict=True):
        if len(ids) > room and not truncate:
            check_positions(len(ids), max_new_tokens, width, positions, name)
            raise ValueError(f"{name}: {len(ids)} prompt tokens, more than the largest prompt bucket {room}")
        if len(ids) > room:
            cut[name] = [len(ids), room]
            print(f"{name}: cut from {len(ids)} to its last {room} tokens (--truncate-prompts)", file=sys.stderr)
            ids = ids[-room:]
        out.append(ids)
    return out, cut
