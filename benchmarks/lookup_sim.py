"""Lookup drafters simulated offline on the target's own greedy outputs: what a lookup tree's weights come from, and
how it compares with prompt lookup and reply lookup before any decode is timed.

  .venv/bin/python benchmarks/lookup_sim.py [--outputs runs/lookup-sim/dev.jsonl] [--out docs/results/...json]

Greedy decoding is deterministic, so the tokens a speculative decoder commits are the plain greedy output whatever
it drafts, and a round's accepted length follows from its drafts and that output alone (checked: the simulated
accept lengths of n-gram and reply lookup equal the engine's, round for round, on the committed evals). A decoder's
speedup is then its committed tokens over the summed cost of its rounds, each at the verify cost of its width
(`--costs`: this machine's measured curve). The simulator is plain Python, written here as a second, independent
implementation of the lookups (dict-of-counts, list scans); no library simulates speculative decoding.

Dev prompts only: GSM8K 200-263, HumanEval 100-163, MT-Bench 40-79 (the held-out evals use the first 10 of each).
Their greedy outputs (256 new tokens, chat template, stop tokens) are generated once, batched, into --outputs.

It prints and writes:
  * calibration: per lookup (context suffix, reply n-gram) and order, how often a candidate with a given share of
    its lookup's occurrences is the target's next token, at every position of every output, and the least-squares
    slope of that rate against the share (`proposers.LookupTreeProposer`'s weights);
  * per set: tau and the predicted speedup of n-gram K=8, reply lookup K=8 and the lookup tree at 7 nodes.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import sys
from pathlib import Path

import numpy as np

from dflash_model.files import atomic_write_text, check_out_file

ROOT = Path(__file__).resolve().parents[1]
DEV = {"gsm8k": (200, 264), "humaneval": (100, 164), "mtbench": (40, 80)}
# Verify cost (ms) by width on the 2-core AVX-512 EPYC (docs/results/decoding/cache-write/, fixed-width rounds).
COSTS = {1: 16.9, 2: 20.5, 4: 22.2, 8: 25.4, 16: 33.2}


def generate_outputs(path: Path, max_new: int) -> None:
    from dflash_model.tokenizer import stop_token_ids
    from infer.eval_sets import dataset_messages, encode
    from infer.plain import greedy_generate
    from infer.target_spec import load_target_spec

    target = load_target_spec("smollm2")
    stops = stop_token_ids(target.tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for name, (lo, hi) in DEV.items():
            rows = dataset_messages(name)[lo:hi]
            prompts = encode(rows, target.tokenizer)
            for i in range(0, len(prompts), 8):
                outs = greedy_generate(target.model, prompts[i : i + 8], max_new, stop_ids=stops)
                for r, p, o in zip(rows[i : i + 8], prompts[i : i + 8], outs):
                    f.write(json.dumps({"set": name, "id": r["id"], "prompt": p, "out": o}) + "\n")
                print(f"{name} {min(i + 8, len(prompts))}/{len(prompts)}", file=sys.stderr, flush=True)


def cost(width: int, costs: dict[int, float]) -> float:
    """The measured cost at `width`, linear between measured widths."""
    ks = sorted(costs)
    if width in costs:
        return costs[width]
    for a, b in zip(ks, ks[1:]):
        if a < width < b:
            return costs[a] + (costs[b] - costs[a]) * (width - a) / (b - a)
    raise ValueError(f"no cost for width {width}")


class Replies:
    """{n-gram: Counter of the reply tokens that followed it} over a reply file (`python -m infer.replies`)."""

    def __init__(self, path, min_n: int, max_n: int):
        z = np.load(path)
        ids, mask, offsets = z["input_ids"].tolist(), z["loss_mask"], z["offsets"]
        self.min_n, self.max_n = min_n, max_n
        self.table = collections.defaultdict(collections.Counter)
        for r in range(len(offsets) - 1):
            lo, hi = int(offsets[r]), int(offsets[r + 1])
            for p in range(lo, hi):
                if mask[p]:
                    for n in range(min_n, max_n + 1):
                        if p - n >= lo:
                            self.table[tuple(ids[p - n : p])][ids[p]] += 1

    def followers(self, seq):
        """(order, Counter) of the longest n-gram of seq's tail in the table; (0, None) if none."""
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(seq) >= n and (c := self.table.get(tuple(seq[-n:]))):
                return n, c
        return 0, None


def context_followers(seq, max_n: int):
    """(n, Counter of the tokens after each earlier occurrence of seq's last n tokens, {token: its latest
    occurrence's end}), n the longest with any."""
    for n in range(max_n, 0, -1):
        if len(seq) >= n + 1:
            suffix = seq[-n:]
            ends = [i for i in range(n - 1, len(seq) - 1) if seq[i - n + 1 : i + 1] == suffix]
            if ends:
                return n, collections.Counter(seq[i + 1] for i in ends), {seq[i + 1]: i for i in ends}
    return 0, collections.Counter(), {}


def prompt_lookup(seq, k: int, max_n: int = 3):
    """infer.proposers.NGramProposer: the latest earlier match of the longest suffix, continued periodically; its
    match length (tokens agreeing backwards, up to 16). (None, 0) without a match."""
    for n in range(max_n, 0, -1):
        if len(seq) < n + 1:
            continue
        best = next((i for i in range(len(seq) - 2, n - 2, -1) if seq[i - n + 1 : i + 1] == seq[-n:]), -1)
        if best >= 0:
            period = max(len(seq) - 1 - best, 1)
            drafts = [seq[best + 1 + j % period] for j in range(k - 1)]
            agree = 0
            while agree < 16 and best - agree >= 0 and seq[best - agree] == seq[len(seq) - 1 - agree]:
                agree += 1
            return drafts, agree
    return None, 0


def ngram_chain(seq, k, replies=None):
    drafts, _ = prompt_lookup(seq, k)
    return drafts or [seq[-1]] * (k - 1)


def reply_chain(seq, k, replies):
    """infer.proposers.ReplyLookupProposer: a 2+ token context match, else the replies' continuation, else any."""
    drafts, agree = prompt_lookup(seq, k)
    if agree >= 2:
        return drafts
    s, out = list(seq), []
    for step in range(k - 1):
        n, c = replies.followers(s)
        if step == 0 and c is None:
            return drafts or [seq[-1]] * (k - 1)
        tok = min(c.items(), key=lambda kv: (-kv[1], kv[0]))[0] if c else s[-1]
        out.append(tok)
        s.append(tok)
    return out


def tree_children(seq, replies, ctx_weight, rep_weight, ctx_max_n, fanout=4):
    """LookupTreeProposer.children: each lookup's 4 likeliest followers (context ties to the latest occurrence,
    reply ties to the smaller id), weighted by order, merged, scaled to sum <= 1; the top `fanout` (ties to the
    smaller id: the engine's `top_k` breaks them by slot, so a tied tree can differ there)."""
    nc, cc, last = context_followers(seq, ctx_max_n)
    nr, cr = replies.followers(seq)
    pc = {}
    if cc:
        top = sorted(cc.items(), key=lambda kv: (-kv[1], -last[kv[0]]))[:4]
        pc = {t: ctx_weight[nc] * c / sum(cc.values()) for t, c in top}
    ranked = sorted(cr.items(), key=lambda kv: (-kv[1], kv[0]))[:4] if cr else []
    pr = {t: rep_weight[nr] * c / sum(cr.values()) for t, c in ranked}
    p = {t: 1 - (1 - pc.get(t, 0.0)) * (1 - pr.get(t, 0.0)) for t in set(pc) | set(pr)}
    total = max(sum(p.values()), 1.0)
    return sorted(((t, q / total) for t, q in p.items()), key=lambda kv: (-kv[1], kv[0]))[:fanout]


def lookup_tree(seq, nodes, replies, **weights):
    """The set of draft paths (tuples) of the best-first tree of `nodes` nodes."""
    kept, heap = set(), [(-q, (t,)) for t, q in tree_children(seq, replies, **weights)]
    heapq.heapify(heap)
    while heap and len(kept) < nodes:
        neg, path = heapq.heappop(heap)
        kept.add(path)
        for t, q in tree_children(seq + list(path), replies, **weights):
            heapq.heappush(heap, (neg * q, (*path, t)))
    return kept


def simulate(rows, costs, *, chain=None, k=8, tree_nodes=None, replies=None, weights=None):
    """(tau, predicted speedup over plain) of greedy decoding of rows with a chain proposer or a lookup tree."""
    tokens = rounds = 0
    spec_ms = plain_ms = 0.0
    for r in rows:
        prompt, out = r["prompt"], r["out"]
        n = 1  # the prefill gives the first token
        while n < len(out):
            seq = prompt + out[:n]
            if tree_nodes:
                paths = lookup_tree(seq, tree_nodes, replies, **weights)
                a = 0
                while a < len(out) - n and tuple(out[n : n + a + 1]) in paths:
                    a += 1
                width = tree_nodes + 1
            else:
                drafts = chain(seq, k, replies)
                a = next((j for j, (d, t) in enumerate(zip(drafts, out[n:])) if d != t), min(len(drafts), len(out) - n))
                width = k
            step = min(a + 1, len(out) - n)
            n, tokens, rounds = n + step, tokens + step, rounds + 1
            spec_ms += cost(width, costs)
        plain_ms += (len(out) - 1) * cost(1, costs)
    return {"tau": tokens / rounds, "speedup": plain_ms / spec_ms}


def calibrate(rows, replies, ctx_max_n):
    """{(lookup, order): slope, [(share bin centre, rate, count)]}: how often a candidate with that share of its
    lookup's occurrences was the next token, over every position of every output."""
    stats = collections.defaultdict(lambda: np.zeros((5, 2)))
    for r in rows:
        prompt, out = r["prompt"], r["out"]
        for n in range(1, len(out)):
            seq, truth = prompt + out[:n], out[n]
            nc, cc, _ = context_followers(seq, ctx_max_n)
            nr, cr = replies.followers(seq)
            found = [("context", nc, cc.items() if cc else [])]
            found.append(("replies", nr, sorted(cr.items(), key=lambda kv: -kv[1])[:4] if cr else []))
            for lookup, order, items in found:
                total = sum(c for _, c in (cc.items() if lookup == "context" else (cr or {}).items()))
                for t, c in items:
                    b = min(int(c / total * 5), 4)
                    stats[(lookup, order)][b] += (t == truth, 1)
    out = {}
    centre = 0.1 + 0.2 * np.arange(5)
    for key, s in sorted(stats.items()):
        hits, tries = s[:, 0], s[:, 1]
        rate = np.where(tries > 0, hits / np.maximum(tries, 1), 0.0)
        slope = float((tries * centre * rate).sum() / (tries * centre**2).sum())
        bins = [(round(float(c), 1), round(float(x), 3), int(t)) for c, x, t in zip(centre, rate, tries) if t > 0]
        out[f"{key[0]} {key[1]}"] = {"slope": round(slope, 3), "bins (share, rate, count)": bins}
    return out


def _shown(path) -> str:
    """A path as a committed result may show it: relative to the repository, else its file name (no path of this
    machine)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else resolved.name


def write_prior(args, rows, replies, weights) -> None:
    """The lookup tree's simulated tau at each size on every dev set, and their mean (each set weighted equally):
    what `Engine.calibrate` divides by each size's measured round cost to choose the size at start-up."""
    per_set = {}
    for name in DEV:
        rs = [r for r in rows if r["set"] == name]
        per_set[name] = {
            str(n): round(simulate(rs, COSTS, tree_nodes=n, replies=replies, weights=weights)["tau"], 4)
            for n in args.sizes
        }
        print(f"{name}: tau by tree size {per_set[name]}", flush=True)
    mean = {str(n): round(sum(t[str(n)] for t in per_set.values()) / len(per_set), 4) for n in args.sizes}
    prior = {
        "about": "simulated tau (committed tokens per round) of the lookup tree at each size, greedy, on the dev "
        "prompts' outputs (benchmarks/lookup_sim.py); tau is the mean over the sets",
        "command": " ".join(
            ["python benchmarks/lookup_sim.py --outputs", _shown(args.outputs), "--replies", _shown(args.replies)]
            + ["--prior-out", _shown(args.prior_out)]
            + ["--sizes", *map(str, args.sizes)]
        ),
        "tau": mean,
        "per_set": per_set,
    }
    args.prior_out.parent.mkdir(parents=True, exist_ok=True)
    args.prior_out.write_text(json.dumps(prior, indent=1) + "\n")
    print(f"wrote {args.prior_out}: mean tau by size {mean}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--outputs", type=Path, default=Path("runs/lookup-sim/dev.jsonl"))
    ap.add_argument("--replies", default="drafters/smollm2-135m-replies/replies.npz")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=None, help="JSON of the calibration and the simulated table")
    ap.add_argument(
        "--prior-out",
        type=Path,
        default=None,
        help="also simulate the tree at each of --sizes and write its tau per size, the mean over the dev sets, as "
        "the start-up size choice's prior (tree_tau.json beside the reply file: infer.loading)",
    )
    ap.add_argument("--sizes", type=int, nargs="+", default=[3, 5, 7, 9, 11, 15], help="tree sizes for --prior-out")
    args = ap.parse_args(argv)
    if args.out:
        check_out_file(args.out, "--out")
    check_out_file(args.outputs, "--outputs")
    if not args.outputs.is_file():
        generate_outputs(args.outputs, args.max_new_tokens)
    rows = [json.loads(line) for line in open(args.outputs)]
    from infer.proposers import LOOKUP_TREE_ORDERS, LookupTreeProposer

    tree = LookupTreeProposer()
    replies = Replies(args.replies, *LOOKUP_TREE_ORDERS)
    chain_replies = Replies(args.replies, 2, 4)  # reply lookup's own index (infer.replies.load_index defaults)
    weights = dict(ctx_weight=tree.context_weight, rep_weight=tree.reply_weight, ctx_max_n=tree.max_n)
    calibration = calibrate(rows, replies, tree.max_n)
    print("calibration (slope: rate of being the next token per unit of share):")
    for key, v in calibration.items():
        print(f"  {key:10s} {v['slope']:.3f}  {v['bins (share, rate, count)']}")
    table = {}
    print("| set | n-gram K=8 | reply lookup K=8 | lookup tree, 7 nodes | tree / n-gram |")
    print("|---|---:|---:|---:|---:|")
    for name in DEV:
        rs = [r for r in rows if r["set"] == name]
        res = {
            "ngram@8": simulate(rs, COSTS, chain=ngram_chain),
            "replies@8": simulate(rs, COSTS, chain=reply_chain, replies=chain_replies),
            "lookuptree7": simulate(rs, COSTS, tree_nodes=7, replies=replies, weights=weights),
        }
        table[name] = res
        cells = [f"{v['speedup']:.2f}x, tau {v['tau']:.2f}" for v in res.values()]
        ratio = res["lookuptree7"]["speedup"] / res["ngram@8"]["speedup"]
        print(f"| {name} ({len(rs)}) | " + " | ".join(cells) + f" | {ratio:.2f} |")
    if args.prior_out:
        write_prior(args, rows, replies, weights)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(
            args.out, json.dumps({"costs_ms": COSTS, "calibration": calibration, "simulated": table}, indent=1)
        )
    return 0


if __name__ == "__main__":
    from dflash_model.cli import run_main

    raise SystemExit(run_main(main))
