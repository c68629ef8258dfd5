"""ms per decode round at width w: a fixed-width engine (no switch) against an adaptive engine whose cost table makes
it choose w every round (a lax.switch over widths 1/2/4/8/16 that always takes w). n-gram proposer, SmolLM2, the
first 3 MT-Bench prompts, 256 new tokens; the best of 3 decodes per prompt.

    .venv/bin/python docs/results/decoding/cache-write/switch_cost.py 2 8
"""

import sys

from infer.engine import Engine
from infer.eval_sets import dataset_messages, encode
from infer.measure import timed_batch, warm
from infer.proposers import NGramProposer
from infer.target_spec import load_target_spec

t = load_target_spec("smollm2")
prompts = encode(dataset_messages("mtbench", 3), t.tokenizer)
widths = (1, 2, 4, 8, 16)
for w in (int(x) for x in sys.argv[1:]):
    fixed = Engine(t.model, NGramProposer(), block_size=w, max_new_tokens=256)
    ad = Engine(t.model, NGramProposer(), block_size=16, max_new_tokens=256, adaptive=True)
    ad.costs = {"widths": list(widths), "verify_ms": [1.0 if x == w else 1e4 for x in widths], "draft_ms": 0.0}
    for name, eng in (("fixed", fixed), ("adaptive", ad)):
        per = []
        for p in prompts:
            ids, lengths, key = eng.inputs([p])
            warm(eng, ids, lengths, key)
            best = min(timed_batch(eng, ids, lengths, key)[0] for _ in range(3))
            gen = timed_batch(eng, ids, lengths, key)[1][0]
            per.append(1e3 * best / len(gen.accept_lengths))
            assert set(gen.verify_widths) == {w}, set(gen.verify_widths)
        print(f"width {w:2d} {name:8s} ms/round " + " ".join(f"{x:.2f}" for x in per), flush=True)
