"""Resolve the CLIs' --draft argument into a proposer and its parameters (--target: infer/target_spec.py), and the
checks of their lengths and token ids."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from dflash_model import drafter_weights
from dflash_model.config import PRESETS
from dflash_model.drafter import build_drafter
from dflash_model.drafter_config import DRAFTER_PRESETS, drafter_config_for
from infer import proposers
from infer.engine import checked_tree_prior
from infer.plain import PROMPT_BUCKETS
from infer.replies import load_index
from infer.spec import MAX_BLOCK, MAX_TREE_NODES, check_positions

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
    """argparse type: a finite float >= 0 (nan and inf refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value >= 0.0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text} is negative or not a finite number")
    return value


@dataclasses.dataclass
class Draft:
    name: str
    proposer: Any
    params: Any
    block_size: int  # the K to use (the drafter's trained K unless --block says otherwise)
    adaptive: bool = False  # verify a width chosen per round (infer.adaptive.choose_width), not always K
    tree_nodes: int | None = None  # verify a draft tree of this many nodes per round (infer.tree), not a chain
    # {tree size: expected committed tokens per round}: the engine chooses its tree size among these at start-up
    # from the costs it measures (infer.engine.Engine.calibrate)
    tree_prior: dict[int, float] | None = None

    @property
    def width(self) -> int:
        """The widest verify this draft runs (K, or a tree's nodes + 1): what a decode needs beyond its tokens."""
        return max(self.block_size, (self.tree_nodes or 0) + 1)

    def engine_options(self) -> dict:
        """The `infer.engine.Engine` keywords this draft decodes with."""
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


class DraftForm(NamedTuple):
    """One form of a --draft value: `pattern` (a regex over the whole value) -> `build(match, ctx)`."""

    usage: str
    meaning: str
    pattern: str
    build: Callable[[re.Match, _Ctx], Draft]
    # what follows the prefix's ':' (and a second part's '+'), named when a value leaves it empty: Path('') would
    # be read as the current directory
    needs: tuple[str, ...] = ()

    @property
    def prefix(self) -> str:
        """'lookuptree' of 'lookuptree[N|auto]:FILE'."""
        return re.split(r"[\[:]", self.usage)[0]


@dataclasses.dataclass(frozen=True)
class _Ctx:
    """What every form is built with: the whole value (for messages) and `load_draft_spec`'s options."""

    spec: str
    target_cfg: Any
    block: int | None
    seed: int
    dtype: str | None
    zero_features: bool

    def inner(self, spec: str) -> Draft:
        """The spec a prefix wraps, with this value's options."""
        return load_draft_spec(
            spec, self.target_cfg, self.block, self.seed, dtype=self.dtype, zero_features=self.zero_features
        )

    def refuse(self, why: str) -> ValueError:
        return ValueError(f"--draft {self.spec!r}: {why}")


def _none(m, c: _Ctx) -> Draft:
    if c.block not in (None, 1):
        raise ValueError("--draft none decodes one token per step: --block must be 1 or left out")
    return Draft("none", proposers.NoProposer(), None, 1)


def _ngram(m, c: _Ctx) -> Draft:
    return Draft("ngram", proposers.NGramProposer(), None, c.block or NGRAM_BLOCK)


def _random(m, c: _Ctx) -> Draft:
    cfg, drafter = random_drafter(c.target_cfg, seed=c.seed)
    return dflash_draft("random", drafter, cfg, c.block, zero_features=c.zero_features)


def _directory(m, c: _Ctx) -> Draft:
    cfg, drafter = drafter_weights.load_drafter(c.spec, c.target_cfg, dtype=c.dtype)
    vocab = drafter_weights.load_draft_vocab(c.spec, cfg.vocab_size)
    return dflash_draft("dflash", drafter, cfg, c.block, zero_features=c.zero_features, vocab=vocab)


def _fullvocab(m, c: _Ctx) -> Draft:
    # The drafter over the whole vocabulary, ignoring its draft_vocab.json (what a z-lab server does).
    inner = c.inner(m[1])
    if not isinstance(inner.proposer, proposers.DFlashProposer):
        raise c.refuse("fullvocab: applies to a DFlash drafter directory")
    proposer = dataclasses.replace(inner.proposer, vocab=None)
    return dataclasses.replace(inner, name=f"fullvocab-{inner.name}", proposer=proposer)


def _adaptive(m, c: _Ctx) -> Draft:
    inner = c.inner(m[1])
    if inner.block_size < 2:
        raise c.refuse("plain decoding has no width to choose")
    if inner.tree_prior is not None:
        raise c.refuse("a tree size per run or a width per round, not both: lookuptreeN")
    return dataclasses.replace(inner, name=f"adaptive-{inner.name}", adaptive=True)


def _hybrid(m, c: _Ctx) -> Draft:
    # Prompt lookup where the context has a match, this drafter's block elsewhere (proposers.HybridProposer).
    inner = c.inner(m[1])
    return dataclasses.replace(inner, name="hybrid", proposer=proposers.HybridProposer(inner.proposer))


def _replies(m, c: _Ctx) -> Draft:
    # Prompt lookup where the context matches, the target's past replies elsewhere (infer.replies).
    return Draft(
        "replies", proposers.ReplyLookupProposer(), load_index(m[1], c.target_cfg.vocab_size), c.block or NGRAM_BLOCK
    )


def _replies_hybrid(m, c: _Ctx) -> Draft:
    # replies:FILE where it is confident, this drafter's block elsewhere (proposers.ReplyHybridProposer). FILE
    # ends at the last "+" (the pattern is greedy): a reply file's name may hold one, a directory's may not.
    index = load_index(m[1], c.target_cfg.vocab_size)
    inner = c.inner(m[2])
    if not isinstance(inner.proposer, proposers.DFlashProposer):
        raise c.refuse("replies:FILE+DIR needs a DFlash drafter directory (or random)")
    proposer = proposers.ReplyHybridProposer(inner.proposer)
    return dataclasses.replace(inner, name="replies-hybrid", proposer=proposer, params=(inner.params, index))


def _tree(m, c: _Ctx) -> Draft:
    nodes = _tree_nodes(c.spec, m[1] or TREE_NODES)  # before the drafter loads
    inner = c.inner(m[2])
    if not isinstance(inner.proposer, proposers.DraftsTop):
        raise c.refuse("a draft tree needs a DFlash drafter (a directory or random)")
    return dataclasses.replace(inner, name=f"tree{nodes}-{inner.name}", tree_nodes=nodes)


def _lookup_tree(m, c: _Ctx) -> Draft:
    return _lookup_tree_draft(c.spec, m[1], m[2], c.target_cfg, c.block)


# The --draft grammar, tried in order (a prefix form before the directory that would match anything). Its help
# (`DRAFT_HELP`) and its one error message come from this table.
DRAFT_FORMS = (
    DraftForm("none", "plain decoding (one token a step)", r"none", _none),
    DraftForm("ngram", f"prompt lookup (K={NGRAM_BLOCK} unless given)", r"ngram", _ngram),
    DraftForm("random", "an untrained DFlash drafter made for the target", r"random", _random),
    DraftForm(
        "lookuptree[N|auto]:FILE",
        "a tree of N nodes grown from prompt lookup and a reply file (auto: its "
        "size chosen at start-up from the file's tree_tau.json)",
        r"lookuptree(\d*|auto):(.+)",
        _lookup_tree,
        ("a reply file",),
    ),
    DraftForm(
        "tree[N]:DIR",
        f"a draft tree of N (default {TREE_NODES}) nodes from the drafter's distributions (DDTree)",
        r"tree(\d*):(.+)",
        _tree,
        ("a drafter directory (or random)",),
    ),
    DraftForm(
        "fullvocab:DIR",
        "the drafter over the whole vocabulary (ignoring its draft_vocab.json, as a z-lab server runs it)",
        r"fullvocab:(.+)",
        _fullvocab,
        ("a drafter directory",),
    ),
    DraftForm(
        "adaptive:SPEC",
        "verify a width chosen per round from measured costs",
        r"adaptive:(.+)",
        _adaptive,
        ("a drafter spec (a directory, random, ...)",),
    ),
    DraftForm(
        "hybrid:SPEC",
        "prompt lookup where the context matches, else the drafter",
        r"hybrid:(.+)",
        _hybrid,
        ("a drafter spec (a directory, random, ...)",),
    ),
    DraftForm(
        "replies:FILE+DIR",
        "replies:FILE where it is confident, else the drafter's block",
        r"replies:(.+)\+(.+)",
        _replies_hybrid,
        ("a reply file", "a drafter directory"),
    ),
    DraftForm(
        "replies:FILE",
        "prompt lookup, then a reply file of python -m infer.replies",
        r"replies:(.+)",
        _replies,
        ("a reply file",),
    ),
    DraftForm("DIR", "a DFlash drafter directory (z-lab or speculators format)", r"(.+)", _directory),
)
DRAFT_HELP = "; ".join(f"{f.usage}: {f.meaning}" for f in DRAFT_FORMS)
_AFTER_PREFIX = {f.prefix: f.needs[0] for f in DRAFT_FORMS if f.needs}  # {prefix: what its ':' needs}


def load_draft_spec(
    spec: str,
    target_cfg,
    block: int | None = None,
    seed: int = 0,
    *,
    dtype: str | None = None,
    zero_features: bool = False,
) -> Draft:
    """A --draft value (one of `DRAFT_FORMS`) as a Draft at K = `block` (default: the drafter's own). dtype: a
    directory's compute dtype (default: as saved); zero_features: the features.zero ablation (the drafter sees zeros
    instead of target features). A directory's draft_vocab.json (the draft vocabulary it was trained on) restricts
    its proposals to those tokens."""
    if block is not None and not 1 <= block <= MAX_BLOCK:
        raise ValueError(f"--draft {spec!r}: block size K={block} is outside 1..{MAX_BLOCK}")
    ctx = _Ctx(spec, target_cfg, block, seed, dtype, zero_features)
    empty = re.fullmatch(rf"({'|'.join(_AFTER_PREFIX)})(\d*|auto):", spec)
    if empty:
        raise ctx.refuse(f"{empty[1]}: needs {_AFTER_PREFIX[empty[1]]} after the ':'")
    for form in DRAFT_FORMS:
        if len(form.needs) > 1 and re.fullmatch(rf"{form.prefix}:.+\+", spec):
            raise ctx.refuse(f"{form.usage} needs {form.needs[1]} after the '+'")
    for form in DRAFT_FORMS:
        m = re.fullmatch(form.pattern, spec)
        if m and (form.build is not _directory or Path(spec).is_dir()):
            return form.build(m, ctx)
    raise ctx.refuse("expected one of " + ", ".join(f.usage for f in DRAFT_FORMS))


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


def drafter_block(drafter_dir: str) -> int | None:
    """The block size K a drafter directory was trained with (its config.json), None where it names none."""
    try:
        k = json.loads((Path(drafter_dir) / "config.json").read_text()).get("block_size")
    except (OSError, ValueError, AttributeError):
        return None
    return int(k) if isinstance(k, int) else None


def compare_specs(drafter_dir: str, block: int | None = None) -> list[str]:
    """The --draft values of `--compare DIR`: every way this project decodes with one drafter, and n-gram, at
    K=8 and, named ngram-K<K>, at the drafter's own K (--block where given), the same-K baseline."""
    k = block or drafter_block(drafter_dir)
    same_k = [f"ngram-K{k}=ngram@{k}"] if k and k != NGRAM_BLOCK else []
    return [
        f"ngram@{NGRAM_BLOCK}",
        *same_k,
        "adaptive:ngram@16",
        drafter_dir,
        f"adaptive:{drafter_dir}",
        f"hybrid:{drafter_dir}",
        f"adaptive:hybrid:{drafter_dir}",
        f"tree:{drafter_dir}",
    ]


def load_drafts(specs: list[str], target_cfg, block: int | None, seed: int):
    """Draft objects for --draft values (NAME=SPEC or SPEC, each optionally @K), with distinct names: NAME names
    the row; else a second drafter directory is named by its directory, its prefixes kept (fullvocab:DIR is
    fullvocab-DIRNAME), and by its K too where that is what differs."""
    out = []
    for given in specs:
        label, eq, rest = given.partition("=")
        if not eq or not re.fullmatch(r"[\w.+@-]+", label):
            label, rest = "", given
        spec, at, k = rest.partition("@")
        if at and not k.isdigit():
            raise ValueError(f"--draft {given!r}: the block size after '@' must be a whole number, not {k!r}")
        d = load_draft_spec(spec, target_cfg, int(k) if k else block, seed=seed)
        if label:
            d = dataclasses.replace(d, name=label)
        elif any(o.name == d.name for o in out):
            dir_name = Path(spec.rsplit(":", 1)[-1]).name
            name = d.name.replace("dflash", dir_name) if "dflash" in d.name else f"{d.name}-{dir_name}"
            d = dataclasses.replace(d, name=name if all(o.name != name for o in out) else f"{name}@{d.block_size}")
        if any(o.name == d.name for o in out):
            raise ValueError(f"--draft {given!r}: a second row named {d.name!r}; name it with NAME=SPEC")
        out.append(d)
    return out
