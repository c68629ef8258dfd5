"""docs/results/regen2/summary.md and summary.json from the three eval.json beside it."""

import json
from pathlib import Path

root = Path("docs/results/regen2")
names = {
    "dflash": "continued fine-tune (this run)",
    "smollm2-135m-dflash": "shipped before",
    "ngram": "n-gram",
    "adaptive-ngram": "adaptive n-gram",
    "adaptive-hybrid": "adaptive hybrid (n-gram + continued fine-tune)",
}
rows, out = [], {}
for s in ("humaneval", "gsm8k", "mtbench"):
    f = root / s / "eval.json"
    if not f.exists():
        continue
    d = json.loads(f.read_text())["reports"]
    plain = next(iter(d.values()))["tpot_plain_ms"]
    out[s] = {}
    for k, r in d.items():
        acc = " / ".join(f"{a:.3f}" for a in r["acceptance_unconditional"][:3])
        lossless = f"{r['prompts'] - r['lossless_mismatches']}/{r['prompts']}"
        draft_ms = r["costs_ms"].get(k, {}).get("draft_ms", 0.0)
        rows.append(
            f"| {s} | {names.get(k, k)} | {r['block_size']} | {r['tau']:.3f} | {acc} | {r['mean_verify_width']:.1f} | "
            f"{r['tpot_spec_ms']:.1f} | {r['speedup']:.2f}x | {lossless} |"
        )
        out[s][k] = {
            "tau": r["tau"],
            "speedup": r["speedup"],
            "acceptance": r["acceptance_unconditional"][:3],
            "tpot_plain_ms": plain,
            "tpot_spec_ms": r["tpot_spec_ms"],
            "draft_ms": draft_ms,
        }
    rows.append(f"| {s} | plain | 1 | 1.000 | - | 1.0 | {plain:.1f} | 1.00x | - |")
head = (
    "10 prompts per set (held out: HumanEval, GSM8K, MT-Bench turn 1), up to 256 new tokens, chat template, greedy, "
    "batch 1, fp32, 2-core CPU, plain and every decoder interleaved prompt by prompt, 1 repeat. Both DFlash drafters "
    "propose from their draft vocabulary (draft_vocab.json). Made by `python docs/results/regen2/summary.py`.\n\n"
    "| set | decoder | K | tau | acc. pos 1 / 2 / 3 | width | TPOT ms | speedup | lossless |\n"
    "|---|---|---:|---:|---|---:|---:|---:|---|\n"
)
(root / "summary.md").write_text(head + "\n".join(rows) + "\n")
(root / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
print(head + "\n".join(rows))
