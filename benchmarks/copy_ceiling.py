"""What limits the copy circuit (`drafter.init=copy`): its attention, fitted exactly as train/copy_init.py fits it,
read out with different values, in numpy, on held-out replies. No drafter is built.

    .venv/bin/python benchmarks/copy_ceiling.py [--out FILE]

Data: the default run's regenerated replies (`bash scripts/main.sh` writes them); the match codes and maps are
fitted on rows 1-120 and scored on rows 121+, at every anchor whose next token is a reply token (the labels of
benchmarks/copy_init_probe.py). Each kv group's attention over the context positions before the anchor matches a
query code of x_a against keys fitted from the features (`predictable_codes`, the circuit's slow RoPE dims per group),
scaled to a perfect-match score of `sharpness`; the groups' attentions are averaged. Slot 1 is then read out as:
  fitted_value      argmax over the draft vocabulary of the attention-averaged fitted final hidden (the circuit's
                    value before its rank cut), through the lm_head;
  target_final      the same with the target's exact final hidden;
  target_vote       the attention-weighted vote over the target's argmax at the matched positions;
  text_vote         the attention-weighted vote over the tokens that actually followed there (the text, which
                    n-gram copies), also counted only where the label is in the draft vocabulary, as the three
                    read-outs above are argmaxes over it (`target_vote, full vocabulary` is not);
and the attention's mass on reply positions (the rest is on the prompt), averaged over the anchors.
Slot 2 (`--slot2`, at the first `--sharpness`): keys of the token before each position (x_{i-1} from the features
at i), alone or sharing a head's dims with slot 1's keys (one k_norm over both), read out by text_vote.
"""

from __future__ import annotations

import argparse
import collections
import json
import shlex
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.conversations import iter_jsonl, tokenize_conversation  # noqa: E402
from dflash_model.target import embedding_table, lm_head_weight  # noqa: E402
from infer.target_spec import load_target_spec  # noqa: E402
from train.config import load_config  # noqa: E402
from train.copy_init import collect, predictable_codes, ridge_fit, slow_rope_dims, unit_rms  # noqa: E402
from train.trainer import drafter_config  # noqa: E402
from train.workflow import regenerated_path  # noqa: E402

RIDGE = 10.0  # fit_copy_circuit's default


def _attention(query_BGN, keys_TGN, sharpness: float):
    """[B, T] group-averaged softmax of unit-RMS queries against unit-RMS keys (q_norm / k_norm): the circuit's layer-1
    attention, whose perfect match scores `sharpness` (train/copy_init.py)."""
    unit = lambda x: x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6)
    # a query's n dims against the first n of a key: a perfect match scores `sharpness` (both at unit RMS per dim)
    s = np.einsum("bgn,tgn->gbt", unit(query_BGN), unit(keys_TGN)[..., : query_BGN.shape[-1]])
    s = s * sharpness / query_BGN.shape[-1]
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)).mean(0)


def _vote(p, tokens) -> int:
    votes = collections.defaultdict(float)
    for t, w in zip(tokens, p):
        votes[int(t)] += w
    return max(votes, key=votes.get)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sharpness", type=float, action="append", help="perfect-match scores (default 16)")
    ap.add_argument("--slot2", action="store_true", help="also score slot 2 through keys of the token before")
    ap.add_argument("--out", help="JSON file to write")
    args = ap.parse_args(argv)
    sharpness = args.sharpness or [16.0]

    cfg = load_config("smollm2-135m")
    target = load_target_spec("smollm2")
    path = regenerated_path(cfg.data.regenerate, "smollm2")
    if not path.exists():
        raise SystemExit(f"{path}: no regenerated replies; run `bash scripts/main.sh` first")
    rows = [tokenize_conversation(target.tokenizer, rec["messages"], 384) for _, rec in iter_jsonl(path)]
    dcfg = drafter_config(cfg, target.config)  # the default run's drafter: its target layers, heads and RoPE
    fit = collect(target.model, [r["input_ids"] for r in rows[:120]], dcfg.target_layer_ids)
    test = collect(target.model, [r["input_ids"] for r in rows[120:]], dcfg.target_layer_ids)
    # kv groups x slow RoPE dims, as fit_copy_circuit picks them for these fit rows (28 per group on SmolLM2 here)
    groups = dcfg.num_key_value_heads
    dims = len(slow_rope_dims(dcfg.head_dim, dcfg.rope_theta, dcfg.rope_scaling, max(len(x[0]) for x in fit)))
    reply = [r["loss_mask"] for r in rows[120:]]
    counts = collections.Counter(np.concatenate([r["input_ids"][r["loss_mask"]] for r in rows[:120]]))
    vocab = np.array([t for t, _ in counts.most_common(int(cfg.draft_vocab))], np.int32)
    full_head = np.asarray(lm_head_weight(target.model), np.float32)  # [D, V]
    head = full_head[:, vocab]  # [D, V']
    in_vocab = np.zeros(full_head.shape[1], bool)
    in_vocab[vocab] = True
    e_hat = unit_rms(np.asarray(embedding_table(target.model), np.float32))

    feats = np.concatenate([unit_rms(x[1][1:]) for x in fit])
    cur = np.concatenate([x[0][1:] for x in fit])
    prev = np.concatenate([x[0][:-1] for x in fit])
    code, w_key = predictable_codes(e_hat, cur, feats, cfg.drafter.mask_token_id, groups * dims, RIDGE)
    w_val = ridge_fit(feats, np.concatenate([x[2][1:] for x in fit]), RIDGE)
    if args.slot2:
        code_prev, w_prev = predictable_codes(e_hat, prev, feats, cfg.drafter.mask_token_id, groups * dims, RIDGE)

    hits, total = collections.Counter(), collections.Counter()
    for (ids, f, final), mask in zip(test, reply):
        f = unit_rms(f)
        keys = (f @ w_key).reshape(len(ids), groups, dims)
        fitted = f @ w_val @ head
        exact = final @ head
        exact_full = (final @ full_head).argmax(-1)
        anchors = np.array([a for a in range(2, len(ids) - 1) if mask[a + 1]])
        for a in anchors:
            q = (e_hat[ids[a]] @ code.T).reshape(1, groups, dims)
            total["slot1"] += 1
            for s in sharpness:
                p = _attention(q, keys[1:a], s)[0]  # context positions 1 .. a-1 (position 0 left out, as in the fit)
                hits[f"slot1 fitted_value s={s:g}"] += vocab[np.argmax(p @ fitted[1:a])] == ids[a + 1]
                hits[f"slot1 target_final s={s:g}"] += vocab[np.argmax(p @ exact[1:a])] == ids[a + 1]
                hits[f"slot1 target_vote s={s:g}"] += _vote(p, vocab[exact[1:a].argmax(-1)]) == ids[a + 1]
                text_hit = _vote(p, ids[2 : a + 1]) == ids[a + 1]
                hits[f"slot1 text_vote s={s:g}"] += text_hit
                hits[f"slot1 text_vote, labels in the draft vocabulary only s={s:g}"] += (
                    text_hit and in_vocab[ids[a + 1]]
                )
                hits[f"slot1 target_vote, full vocabulary s={s:g}"] += _vote(p, exact_full[1:a]) == ids[a + 1]
                hits[f"slot1 match mass on reply text s={s:g}"] += float(p @ mask[1:a])
        if args.slot2:
            prev_keys = (f @ w_prev).reshape(len(ids), groups, dims)
            half = dims // 2
            for a in anchors:
                if a + 2 >= len(ids) or not mask[a + 2]:
                    continue
                total["slot2"] += 1
                q = (e_hat[ids[a]] @ code_prev.T).reshape(1, groups, dims)
                for name, qq, kk in (
                    (f"alone, {dims} dims", q, prev_keys[1:a]),
                    (f"alone, {half} dims", q[..., :half], prev_keys[1:a, :, :half]),
                    (
                        f"{half} dims sharing k_norm with {half} of slot 1's",
                        q[..., :half],
                        np.concatenate([prev_keys[1:a, :, :half], keys[1:a, :, :half]], -1),
                    ),
                ):
                    p = _attention(qq, kk, sharpness[0])[0]
                    hits[f"slot2 text_vote, keys {name}"] += _vote(p, ids[2 : a + 1]) == ids[a + 2]
    result = {
        k: round(v / total["slot2" if k.startswith("slot2") else "slot1"], 3) for k, v in sorted(hits.items())
    } | {"labels": dict(total)}
    print("| read-out | top-1 |\n|---|---:|")
    for k, v in result.items():
        if k != "labels":
            print(f"| {k} | {v:.3f} |")
    print("labels:", result["labels"])
    if args.out:
        out = {"command": shlex.join(["benchmarks/copy_ceiling.py", *sys.argv[1:]]), "results": result}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
