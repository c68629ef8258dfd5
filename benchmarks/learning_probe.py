"""How fast does a SmolLM2-135M drafter learn? Short training probes on the default run's data, and the count-based
baselines that bound what its first block position could reach.

  .venv/bin/python benchmarks/learning_probe.py NAME [--steps 100] [key=value ...]   # one probe
  .venv/bin/python benchmarks/learning_probe.py --baselines                         # count baselines
  .venv/bin/python benchmarks/learning_probe.py --table                             # markdown of all results

A probe trains the default config (`configs/smollm2-135m.yml`, with the key=value overrides) for `--steps` steps
on the default run's regenerated replies (run `bash scripts/main.sh` once first) and reports loss and top-1
accuracy of block positions 1-3 over windows of 20 steps, weighted by valid labels. The data is mostly unseen
in the first epoch, so these accuracies are close to held-out ones. Results: docs/results/probes/<NAME>.json.

The baselines score, on the last 20% of those replies, next-token predictors fitted on the first 80%: the most
frequent token (unigram), the most frequent successor of the previous token (bigram), and the token that
followed the previous token's latest earlier occurrence in the prompt and reply so far (in-context copy, what
n-gram drafting exploits), then copy with bigram as the fallback. They are what position 1 of a drafter could
reach from simple statistics of the same data.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

from data.conversations import iter_jsonl
from train.tiny_runs import accuracy_windows

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "results" / "probes"


def _data_file():
    from train.config import load_config
    from train.workflow import regenerated_path

    path = regenerated_path(load_config("smollm2-135m", []).data.regenerate, "smollm2")
    if not path.exists():
        sys.exit(f"{path} does not exist: run `bash scripts/main.sh` once (it regenerates the default data)")
    return path


def probe(name: str, steps: int, overrides: list[str]) -> dict:
    from train.config import load_config
    from train.trainer import Trainer

    run_dir = REPO / "runs" / "probes" / name
    cfg = load_config(
        "smollm2-135m",
        [
            f"data.source={_data_file()}",
            f"run_dir={run_dir}",
            "eval.enabled=false",
            "export.enabled=false",
            "log.tensorboard=false",
            f"checkpoint.every_steps={steps}",
            *overrides,
        ],
    )
    t0 = time.time()
    tr = Trainer(cfg, restore=False)
    tr.train(max_steps=steps)
    return summarize(name, steps, overrides, wall_s=time.time() - t0)


def summarize(name: str, steps: int, overrides: list[str], wall_s: float | None = None) -> dict:
    """docs/results/probes/<name>.json from runs/probes/<name>/metrics.jsonl (the last `steps` records)."""
    run_dir = REPO / "runs" / "probes" / name
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-steps:]
    out = {
        "name": name,
        "overrides": overrides,
        "steps": steps,
        "wall_s": wall_s,
        "anchors_per_s": statistics.median(r["anchors_per_s"] for r in recs[1:]),
        "windows": accuracy_windows(recs),
        "machine": platform.processor() or platform.machine(),
        "command": shlex.join(["benchmarks/learning_probe.py", name, "--steps", str(steps), *overrides]),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(out, indent=1))
    return out


def baselines() -> dict:
    from data import assets
    from data.conversations import tokenize_conversation
    from dflash_model.tokenizer import load_tokenizer

    tok = load_tokenizer(assets.path("smollm2"))
    rows = []
    for _, rec in iter_jsonl(_data_file()):
        r = tokenize_conversation(tok, rec["messages"], max_len=384)
        ids, mask = r["input_ids"].tolist(), r["loss_mask"].tolist()
        rows.append((ids, mask.index(True) if True in mask else len(ids)))
    cut = int(0.8 * len(rows))
    fit, score = rows[:cut], rows[cut:]
    uni = collections.Counter(t for ids, s in fit for t in ids[s:])
    big = collections.defaultdict(collections.Counter)
    for ids, s in fit:
        for x, y in zip(ids[s:], ids[s + 1 :]):
            big[x][y] += 1
    top = uni.most_common(1)[0][0]
    hits = collections.Counter()
    n = 0
    for ids, s in score:
        last_seen = {}
        for i in range(len(ids) - 1):
            if i >= s + 1:  # predict ids[i+1] from ids[:i+1]; ids[i] is the block's given token
                x, y = ids[i], ids[i + 1]
                bigram = big[x].most_common(1)[0][0] if big[x] else top
                copy = ids[last_seen[x] + 1] if x in last_seen else None
                n += 1
                hits["unigram"] += y == top
                hits["bigram"] += y == bigram
                hits["in-context copy"] += y == copy
                hits["copy, else bigram"] += y == (bigram if copy is None else copy)
            last_seen[ids[i]] = i
    out = {
        "fit_replies": len(fit),
        "scored_replies": len(score),
        "scored_positions": n,
        "fit_tokens": sum(len(ids) - s for ids, s in fit),
        "top1": {k: v / n for k, v in hits.items()},
        "data": str(_data_file().name),
        "command": "benchmarks/learning_probe.py --baselines",
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "count-baselines.json").write_text(json.dumps(out, indent=1))
    return out


def table() -> str:
    lines = [
        "| probe | overrides | anchors/s | loss, steps 81-100 | acc pos 1 / 2 / 3, steps 1-20 | "
        "acc pos 1 / 2 / 3, steps 81-100 |",
        "|---|---|---:|---:|---|---|",
    ]
    for path in sorted(OUT.glob("*.json")):
        r = json.loads(path.read_text())
        if "windows" not in r or path.name.startswith("synthetic-"):
            continue
        first, last = r["windows"][0], r["windows"][-1]
        fmt = " / ".join(f"{a:.3f}" for a in first["acc_1_2_3"]), " / ".join(f"{a:.3f}" for a in last["acc_1_2_3"])
        lines.append(
            f"| {r['name']} | {' '.join(r['overrides']) or '(default)'} | {r['anchors_per_s']:.1f} | "
            f"{last['loss']:.2f} | {fmt[0]} | {fmt[1]} |"
        )
    base = OUT / "count-baselines.json"
    if base.exists():
        b = json.loads(base.read_text())
        lines += [
            "",
            f"Count baselines, next-token top-1 on {b['scored_positions']} reply positions "
            f"(fitted on {b['fit_tokens']} reply tokens):",
            "",
            "| predictor | top-1 |",
            "|---|---:|",
        ]
        lines += [f"| {k} | {v:.3f} |" for k, v in b["top1"].items()]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", nargs="?")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--baselines", action="store_true")
    ap.add_argument("--table", action="store_true")
    args = ap.parse_intermixed_args()
    if args.baselines:
        print(json.dumps(baselines(), indent=1))
    elif args.table:
        print(table())
    elif args.name:
        r = probe(args.name, args.steps, args.overrides)
        for w in r["windows"]:
            print(
                f"steps {w['steps'][0]:>3}-{w['steps'][1]:<3} loss {w['loss']:.2f}  acc 1/2/3 "
                + " / ".join(f"{a:.3f}" for a in w["acc_1_2_3"])
                + f"  {w['step_s']:.2f} s/step"
            )
    else:
        ap.error("give a probe NAME, --baselines or --table")


if __name__ == "__main__":
    main()
