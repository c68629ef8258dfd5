"""Pack what the one-shot GPU job (tools/gpu_burst/job.sh) needs into .dev/ (git-ignored), in parts that each fit
one device call's 64 MiB transfer limit:

  .dev/a/  the first 65 MB of the SmolLM2 GGUF
  .dev/b/  the rest of the GGUF and the shipped drafter the run starts from
  .dev/c/  the cached tokenizer, the ShareGPT first-turn prompts still to regenerate, the replies regenerated here
           already, and the Python wheels the device image lacks
The tree that travels with each call must be small meanwhile (docs/, tests/ and drafters/ moved aside).

    .venv/bin/python tools/gpu_burst/pack.py [--skip 4216]

The prompts are the eligible ones (first turn of at most 256 tokens under the chat template) of ShareGPT records
after --skip, in regenerate's own plan order, written as {id, messages} JSONL.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path

from data.assets import smollm2_gguf
from data.conversations import load_conversations
from dflash_model.files import cache_root
from dflash_model.tokenizer import converted_tokenizer_dir, load_tokenizer
from train.regenerate import plan

ROOT = Path(__file__).resolve().parents[2]
PART = 65_000_000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip", type=int, default=4216, help="ShareGPT records already planned on the CPU")
    cpu_replies = cache_root() / "regenerated/smollm2-sharegpt-skip216-n4000-p256-t256.jsonl"
    ap.add_argument("--replies", default=str(cpu_replies), help="the replies regenerated on the CPU already")
    args = ap.parse_args()
    dev = ROOT / ".dev"
    a, b, c = dev / "a", dev / "b", dev / "c"
    for d in (a, b, c):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    gguf = smollm2_gguf()
    data = gguf.read_bytes()
    (a / "gguf.0").write_bytes(data[:PART])
    (b / "gguf.1").write_bytes(data[PART:])
    shutil.copytree(ROOT / "drafters/smollm2-135m-dflash", b / "drafter", ignore=shutil.ignore_patterns("README.md"))
    (c / "gguf.mtime").write_text(str(int(gguf.stat().st_mtime)))
    tok = load_tokenizer(gguf)  # builds and caches it if this machine has not yet
    tok_dir = converted_tokenizer_dir(gguf)  # job.sh gives the GGUF this mtime again, so the cache key matches there
    shutil.make_archive(str(c / "tokenizers"), "gztar", tok_dir.parent, tok_dir.name)
    convs, _ = load_conversations("sharegpt", skip=args.skip, require_assistant=False)
    eligible, skipped = plan(convs, tok, 256)
    with gzip.open(c / "prompts.jsonl.gz", "wt", encoding="utf-8") as f:
        for rid, prompt, _ in eligible:
            f.write(json.dumps({"id": rid, "messages": prompt}, ensure_ascii=False) + "\n")
    with open(args.replies, "rb") as src, gzip.open(c / "replies_cpu.jsonl.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    if not (dev / "whl").is_dir():
        raise SystemExit(f"{dev / 'whl'}: no wheels; download them first (tools/gpu_burst/README.md)")
    shutil.copytree(dev / "whl", c / "whl")
    sizes = {p.relative_to(dev).as_posix(): p.stat().st_size for p in dev.rglob("*") if p.is_file()}
    print(json.dumps({"prompts": len(eligible), "skipped": dict(skipped), "bytes": sizes}, indent=1))


if __name__ == "__main__":
    main()
