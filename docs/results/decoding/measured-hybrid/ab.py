"""A/B of the hybrid's rule: the adaptive hybrid taking every match (anymatch) against the one choosing by
measured rates, beside n-gram, adaptive n-gram and adaptive DFlash, interleaved per prompt (plain decoding first).

    git apply docs/results/decoding/measured-hybrid/measured-hybrid.patch     # the rule, not kept in the code
    PYTHONPATH=. .venv/bin/python docs/results/decoding/measured-hybrid/ab.py SET LIMIT REPEATS OUT_DIR

writes OUT_DIR/SET/eval.json ({"command", "reports"}, as infer.eval does: benchmarks/eval_summary.py reads it).
"""

import dataclasses
import json
import sys
from pathlib import Path

from dflash_model.tokenizer import stop_token_ids
from infer.eval_sets import dataset_messages, encode
from infer.loading import load_draft_spec
from infer.measure import run_comparison
from infer.report import format_comparison
from infer.target_spec import load_target_spec

dataset, limit, repeats, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
target = load_target_spec("smollm2")
rows = dataset_messages(dataset, limit)
measured = load_draft_spec("adaptive:hybrid:drafters/smollm2-135m-dflash", target.config)
anymatch = dataclasses.replace(
    measured,
    name="adaptive-hybrid-anymatch",
    proposer=dataclasses.replace(measured.proposer, uses_measured=False),
)
drafts = [
    load_draft_spec("ngram", target.config, 8),
    load_draft_spec("adaptive:ngram", target.config, 16),
    load_draft_spec("adaptive:drafters/smollm2-135m-dflash", target.config),
]
reports = run_comparison(
    target.model,
    [*drafts, anymatch, measured],
    encode(rows, target.tokenizer),
    max_new_tokens=256,
    stop_ids=stop_token_ids(target.tokenizer),
    ids=[r["id"] for r in rows],
    progress=False,
    repeats=repeats,
)
print(format_comparison(reports))
Path(out, dataset).mkdir(parents=True, exist_ok=True)
with open(Path(out, dataset, "eval.json"), "w") as f:
    json.dump({"command": " ".join(["ab.py", *sys.argv[1:]]), "reports": reports}, f, indent=1, default=str)
