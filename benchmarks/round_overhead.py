"""Does a DFlash chain round cost more than its verify and drafter forward? Per-round decode time against the two
forwards timed alone (`Engine.calibrate`), with the drafter's context update (`observe`, extend_context) and
without it, on the same prompts, in one process.

  .venv/bin/python benchmarks/round_overhead.py [--draft drafters/smollm2-135m-dflash] [--dataset gsm8k]
      [--limit 3] [--max-new-tokens 128] [--out docs/results/decoding/round-overhead.json]

Without `observe` the drafter keeps its prefill context (its drafts get worse, the output stays lossless), so the
difference between the two per-round times is what extend_context costs inside the loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shlex
import sys
from pathlib import Path

from infer.eval import _timed_decode, _warm, dataset_messages, encode
from infer.loading import load_draft_spec, load_target_spec
from infer.spec import Engine


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="drafters/smollm2-135m-dflash")
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="runs/round-overhead.json")
    a = ap.parse_args(argv)

    target = load_target_spec("smollm2")
    draft = load_draft_spec(a.draft, target.config)
    prompts = encode(dataset_messages(a.dataset, limit=a.limit), target.tokenizer)

    @dataclasses.dataclass(frozen=True)
    class WithoutObserve(type(draft.proposer)):
        def observe(self, params, state, feats_BTF, num_new_B):
            return state

    fields = {f.name: getattr(draft.proposer, f.name) for f in dataclasses.fields(draft.proposer)}
    out = {
        "command": shlex.join(["benchmarks/round_overhead.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": platform.processor() or platform.machine(),
        "variants": {},
    }
    for name, proposer in (("with observe", draft.proposer), ("without observe", WithoutObserve(**fields))):
        engine = Engine(target.model, proposer, draft.params, max_new_tokens=a.max_new_tokens, **draft.engine_options())
        rounds_ms = []
        for prompt in prompts:
            ids, lengths, key = engine.inputs([prompt])
            if engine.costs is None:
                engine.calibrate(ids, lengths, key)
            _warm(engine, ids, lengths, key)
            seconds, gen = _timed_decode(engine, ids, lengths, key)
            rounds_ms.append(1e3 * seconds / len(gen.accept_lengths))
        alone = engine.costs["verify_ms"][-1] + engine.costs["draft_ms"]
        out["variants"][name] = {
            "round_ms": rounds_ms,
            "verify_ms": engine.costs["verify_ms"][-1],
            "draft_ms": engine.costs["draft_ms"],
            "round_over_forwards": [r / alone for r in rounds_ms],
        }
        print(
            f"{name}: round {', '.join(f'{r:.1f}' for r in rounds_ms)} ms; verify {engine.costs['verify_ms'][-1]:.1f} "
            f"+ draft {engine.costs['draft_ms']:.1f} ms alone; ratio "
            + ", ".join(f"{r / alone:.2f}" for r in rounds_ms),
            flush=True,
        )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
