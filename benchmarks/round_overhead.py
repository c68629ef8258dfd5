"""Does a DFlash chain round cost more than its verify and drafter forward? Per-round decode time against the two
forwards timed alone (`Engine.calibrate`), with the drafter's context update (`observe`, extend_context) and
without it, on the same prompts, in one process.

  .venv/bin/python benchmarks/round_overhead.py [--draft drafters/smollm2-135m-dflash] [--dataset gsm8k]
      [--limit 3] [--max-new-tokens 128] [--out docs/results/decoding/round-overhead.json]

Without `observe` the drafter keeps its prefill context (its drafts get worse, the output stays lossless), so the
difference between the two per-round times is what extend_context costs inside the loop.

With a tree draft (`--draft tree:DIR`) it also times, alone at the decode's shapes, what a DDTree round adds to a
chain round: the drafter's top tokens per position (`propose_top`) against its greedy chain, the best-first tree
build, the target forward with the tree mask against a sequential one over as many tokens, the walk and the
cache move (`KVCache.keep_path`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shlex
import sys
from pathlib import Path

from infer.engine import Engine, _loop_ms
from infer.eval import _timed_decode, _warm, dataset_messages, encode
from infer.loading import load_draft_spec
from infer.target_spec import load_target_spec
from infer.tree import build_tree, walk_tree


def tree_parts(engine, proposer, params, st, reps: int = 10) -> dict:
    """ms of each piece of a DDTree round, each alone in a jitted loop of `reps` (see `_loop_ms`)."""
    import jax
    import jax.numpy as jnp

    from dflash_model.target import forward

    nodes, top = engine.static["tree"]
    k, b = engine.static["k"], st.n.shape[0]
    last_B = jnp.take_along_axis(st.history, (st.n - 1)[:, None], axis=1)[:, 0]
    tokens, logp = proposer.propose_top(params, engine.target, st.draft, st.history, st.n, k, top)
    tr = build_tree(tokens, logp, nodes)
    node_tok = jnp.where(tr.valid, tr.token, 0).at[:, 0].set(last_B)

    def looped(step):  # step(i, acc) -> acc: i varies so nothing is hoisted out of the loop
        return jax.jit(lambda r: jax.lax.fori_loop(0, r, step, jnp.float32(0)))

    def drafting(fn):  # the last token varies with i
        return lambda i, acc: acc + jnp.sum(fn(st.history.at[jnp.arange(b), st.n - 1].add(i))).astype(jnp.float32)

    chain = lambda h: proposer.propose(params, engine.target, st.draft, h, st.n, k)
    topk = lambda h: proposer.propose_top(params, engine.target, st.draft, h, st.n, k, top)[1]

    def verify(tree):
        def step(i, acc):
            out = forward(engine.target, node_tok + i, st.cache, layer_ids=proposer.layer_ids, tree=tree)
            return acc + out.logits[0, 0, 0] + out.cache.k[0, 0, 0, 0, 0]

        return step

    def build(i, acc):
        t = build_tree(tokens, logp + i.astype(jnp.float32) * 1e-9, nodes)
        return acc + jnp.sum(t.token) + jnp.sum(t.visible)

    def walk(i, acc):
        path, a = walk_tree((node_tok + i) % 7, tr, k - 1)
        return acc + jnp.sum(path) + jnp.sum(a)

    path, _ = walk_tree(node_tok, tr, k - 1)
    grown = forward(engine.target, node_tok, st.cache, layer_ids=proposer.layer_ids, tree=(tr.depth, tr.visible))

    def move(i, acc):
        c = grown.cache.keep_path(st.cache.lengths, (path + i) % nodes)
        return acc + c.k[0, 0, 0, 0, 0]

    parts = {
        "draft chain (propose)": drafting(chain),
        f"draft top-{top} (propose_top)": drafting(topk),
        "tree build": build,
        f"verify {nodes + 1} tokens, causal": verify(None),
        f"verify {nodes + 1} nodes, tree mask": verify((tr.depth, tr.visible)),
        "walk": walk,
        "cache keep_path": move,
    }
    return {name: _loop_ms(looped(step), reps) for name, step in parts.items()}


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
    if engine.static["tree"]:
        st = engine._prefill(*engine.inputs([prompts[0]]), engine.costs)
        out["tree_parts_ms"] = tree_parts(engine, draft.proposer, draft.params, st)
        for name, ms in out["tree_parts_ms"].items():
            print(f"  {name:32s} {ms:7.2f} ms", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
