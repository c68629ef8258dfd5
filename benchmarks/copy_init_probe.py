"""Held-out slot accuracy of a drafter with no training: the copy circuit of `drafter.init=copy` under different
fitting settings, or an exported drafter directory.

    .venv/bin/python benchmarks/copy_init_probe.py                                  # the defaults
    .venv/bin/python benchmarks/copy_init_probe.py --setting value_scale=4 --setting max_rows=120,ridge=100
    .venv/bin/python benchmarks/copy_init_probe.py --drafter runs/smollm2-135m-b64/export

Data: the default run's regenerated replies (`bash scripts/main.sh` writes them). The circuit is fitted on the
first `--fit-rows` of them and scored on rows `--score-from` on, with the training forward (`train_logits`): top-1
at block slots 1-3 over the 4,096 most frequent reply tokens of the rows before `--score-from` (the default run's
draft vocabulary size), at every anchor whose next token is a reply token. Prints a table; `--out` writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import shlex
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.conversations import iter_jsonl, tokenize_conversation  # noqa: E402
from dflash_model.drafter import build_drafter, train_logits  # noqa: E402
from dflash_model.drafter_weights import load_drafter  # noqa: E402
from dflash_model.target import embedding_table, forward  # noqa: E402
from infer.target_spec import load_target_spec  # noqa: E402
from train.config import load_config, parse_value  # noqa: E402
from train.copy_init import FIT_ROWS, fit_copy_circuit  # noqa: E402
from train.trainer import drafter_config  # noqa: E402
from train.workflow import regenerated_path  # noqa: E402

MAX_LEN, ANCHORS = 384, 128


def slot_accuracy(drafter, target, rows, vocab) -> list[float]:
    lm_rows = np.asarray(embedding_table(target.model), np.float32)[vocab]
    feats = jax.jit(lambda ids: forward(target.model, ids, layer_ids=drafter.config.target_layer_ids).features)
    hits, total = np.zeros(3), np.zeros(3)
    for r in rows:
        ids, mask = r["input_ids"], r["loss_mask"]
        padded = np.zeros(MAX_LEN, np.int32)
        padded[: len(ids)] = ids
        anchors = np.array([a for a in range(1, len(ids) - 1) if mask[a + 1]], np.int32)[:ANCHORS]
        padded_anchors = np.full(ANCHORS, -1, np.int32)
        padded_anchors[: len(anchors)] = anchors
        hidden = train_logits(
            drafter,
            target.model,
            feats(jnp.asarray(padded)[None]),
            jnp.asarray(padded)[None],
            jnp.asarray(padded_anchors)[None],
            drafter.config.block_size,
            hidden_only=True,
        )[0, : len(anchors), 1:4]
        proposals = vocab[np.einsum("nkd,vd->nkv", np.asarray(hidden, np.float32), lm_rows).argmax(-1)]
        for k in range(3):
            ok = anchors + k + 1 < len(ids)
            at = anchors[ok] + k + 1
            keep = mask[at]
            hits[k] += np.sum(proposals[ok, k][keep] == ids[at][keep])
            total[k] += keep.sum()
    return (hits / np.maximum(total, 1)).round(3).tolist()


def _suffix_len(ids: list[int], p: int, a: int, most: int = 8) -> int:
    """How many tokens before p equal those before a (up to `most`)."""
    return next((n for n in range(most) if p - n - 1 < 0 or ids[p - n - 1] != ids[a - n - 1]), most)


def copy_oracles(rows) -> dict:
    """Count predictors of slot 1 (the token after the block's first token x_a) from the row's earlier text, over
    the labels slot_accuracy scores: how much of the target's text an in-context copy mechanism could draft. The
    circuit's attention averages every earlier occurrence of x_a (`vote`); n-gram lookup takes the latest
    occurrence with the longest matching suffix (`longest_suffix`, up to 8 tokens)."""
    hits, total = collections.Counter(), 0
    for r in rows:
        ids, mask = [int(t) for t in r["input_ids"]], r["loss_mask"]
        for a in range(1, len(ids) - 1):
            if not mask[a + 1]:
                continue
            total += 1
            occ = [p for p in range(a) if ids[p] == ids[a]]
            if not occ:
                continue
            label, succ = ids[a + 1], [ids[p + 1] for p in occ]
            best = max(reversed(occ), key=lambda p, a=a, ids=ids: _suffix_len(ids, p, a))  # latest among equals
            hits["has_earlier"] += 1
            hits["latest"] += succ[-1] == label
            hits["vote"] += collections.Counter(succ).most_common(1)[0][0] == label
            hits["longest_suffix"] += ids[best + 1] == label
            hits["any"] += label in succ
    return {k: round(v / max(total, 1), 3) for k, v in hits.items()} | {"labels": total}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--setting",
        action="append",
        default=[],
        help="fit_copy_circuit keywords k=v[,k=v] (repeatable)",
    )
    ap.add_argument("--drafter", help="score this exported drafter directory instead of fitting a circuit")
    ap.add_argument("--fit-rows", type=int, default=120, help="rows the fit may read (max_rows picks how many)")
    ap.add_argument("--score-from", type=int, default=120)
    ap.add_argument("--oracles", action="store_true", help="also print the count predictors of copy_oracles")
    ap.add_argument("--out", help="JSON file to write")
    args = ap.parse_args(argv)

    cfg = load_config("smollm2-135m")
    target = load_target_spec("smollm2")
    path = regenerated_path(cfg.data.regenerate, "smollm2")
    if not path.exists():
        raise SystemExit(f"{path}: no regenerated replies; run `bash scripts/main.sh` first")
    records = [rec for _, rec in iter_jsonl(path)]
    rows = [tokenize_conversation(target.tokenizer, r["messages"], MAX_LEN) for r in records]
    fit_rows, score_rows = rows[: min(args.fit_rows, args.score_from)], rows[args.score_from :]
    counts = collections.Counter(np.concatenate([r["input_ids"][r["loss_mask"]] for r in rows[: args.score_from]]))
    vocab = np.array([t for t, _ in counts.most_common(int(cfg.draft_vocab))], np.int32)

    dcfg = drafter_config(cfg, target.config)  # the default run's drafter: copy-circuit layers, K=64
    results = []
    if args.drafter:
        _, drafter = load_drafter(args.drafter, target.config, dtype="float32")
        results.append({"drafter": args.drafter, "acc_1_2_3": slot_accuracy(drafter, target, score_rows, vocab)})
    for spec in [] if args.drafter else args.setting or [""]:
        kw = dict(item.split("=", 1) for item in spec.split(",") if item)
        kw = {k: parse_value(v) for k, v in kw.items()}
        drafter = fit_copy_circuit(build_drafter(dcfg), target.model, [r["input_ids"] for r in fit_rows], **kw)
        results.append({"setting": kw, "acc_1_2_3": slot_accuracy(drafter, target, score_rows, vocab)})
    print(
        f"fit on the first max_rows (default {FIT_ROWS}) of rows 1-{len(fit_rows)}, scored on rows "
        f"{args.score_from + 1}-{len(rows)}, training forward, K={dcfg.block_size}"
    )
    print("| start | slot 1 | slot 2 | slot 3 |\n|---|---:|---:|---:|")
    for r in results:
        name = r.get("drafter") or ("copy circuit " + (json.dumps(r["setting"]) if r["setting"] else "(defaults)"))
        print(f"| {name} | " + " | ".join(f"{a:.3f}" for a in r["acc_1_2_3"]) + " |")
    oracles = copy_oracles(score_rows) if args.oracles else None
    if oracles:
        print("count predictors of slot 1 on the same labels:", json.dumps(oracles))
    if args.out:
        out = {"command": shlex.join(["benchmarks/copy_init_probe.py", *sys.argv[1:]]), "results": results}
        Path(args.out).write_text(json.dumps(out | ({"oracles": oracles} if oracles else {}), indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
