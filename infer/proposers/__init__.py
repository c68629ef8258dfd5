"""Draft proposers for the speculative engine, one module each behind the `Proposer` protocol (base.py): none
(plain decoding) and the shared hooks in base.py, n-gram prompt lookup (ngram.py), prompt lookup backed by the
target's past replies (reply_lookup.py), a draft tree grown from both lookups (lookup_tree.py), DFlash (dflash.py),
and the hybrids of DFlash with either lookup (hybrid.py)."""

from infer.proposers.base import (
    DRAFTER,
    LOOKUP_TREE,
    LOOKUP_TREE_ORDERS,
    REPEAT,
    REPLIES,
    SOURCES,
    DraftsTop,
    GrowsTree,
    NoProposer,
    Proposal,
    Proposer,
    Scores,
    Stateless,
    WrapsDrafter,
    last_tokens,
    scored,
)
from infer.proposers.dflash import DFlashProposer
from infer.proposers.hybrid import HybridProposer, ReplyHybridProposer
from infer.proposers.lookup_tree import LookupTreeProposer, context_followers
from infer.proposers.ngram import NGramProposer
from infer.proposers.reply_lookup import ReplyLookupProposer

__all__ = [
    "DRAFTER",
    "LOOKUP_TREE",
    "LOOKUP_TREE_ORDERS",
    "REPEAT",
    "REPLIES",
    "SOURCES",
    "DFlashProposer",
    "HybridProposer",
    "LookupTreeProposer",
    "NGramProposer",
    "DraftsTop",
    "GrowsTree",
    "NoProposer",
    "Proposal",
    "Proposer",
    "ReplyHybridProposer",
    "ReplyLookupProposer",
    "Scores",
    "Stateless",
    "WrapsDrafter",
    "context_followers",
    "last_tokens",
    "scored",
]
