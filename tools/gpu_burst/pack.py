"""Pack what the one-shot GPU job (tools/gpu_burst/job.sh) needs into .dev/ (git-ignored), in parts that each fit
one device call's 64 MiB transfer limit:

  .dev/a/  the first 65 MB of the SmolLM2 GGUF
  .dev/b/  the rest of the GGUF and the shipped drafter the run starts from
  .dev/c/  the cached tokenizer, the prompts still to regenerate, the replies regenerated already (to train on
           beside the new ones), and the Python wheels the device image lacks
The tree that travels with each call must be small meanwhile (docs/, tests/ and drafters/ moved aside).

    .venv/bin/python tools/gpu_burst/pack.py [--skip 216] [--replies FILE ...] [--code N] [--math N]

The prompts are the eligible ones (first turn of at most 256 tokens under the chat template) of ShareGPT records
after --skip whose id is in none of the --replies files, in regenerate's own plan order, then with --code up to N
code-completion prompts made from this Python's standard library (`stdlib_code_prompts`), with --code-site up to N
more from the venv's installed packages (`site_code_prompts`), and with --math the first N
template word problems (`data.word_problems`), each less those with a reply already, written as {id, messages} JSONL.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import shutil
import sysconfig
from pathlib import Path

from data.assets import smollm2_gguf
from data.conversations import iter_jsonl, load_conversations
from data.word_problems import word_problems
from dflash_model.tokenizer import converted_tokenizer_dir, load_tokenizer
from train.regenerate import plan

ROOT = Path(__file__).resolve().parents[2]
PART = 65_000_000
# Standard-library folders left out of the code prompts: tests, GUIs, installers and demos.
STDLIB_SKIP = {"test", "tests", "idlelib", "site-packages", "lib2to3", "tkinter", "turtledemo", "ensurepip", "venv"}


def stdlib_code_prompts(limit: int) -> list[dict]:
    """Code-completion prompts from this Python's standard library, in the shape of HumanEval's (a signature and its
    docstring, the body left to the model): each public top-level function and public method of a public class
    with a docstring of at least 60 characters, in sorted file order. No benchmark prompt comes from here, so the
    target's replies to them are training data for code without touching an evaluation set.
    """
    return code_prompts(Path(sysconfig.get_paths()["stdlib"]), "stdlib", limit)


def site_code_prompts(limit: int) -> list[dict]:
    """The same kind of prompts from the packages installed beside this Python (the project's venv: numpy, jax,
    flax, transformers, ...), for more code than the standard library's 2,480 functions hold. Ordered by a hash of
    their ids, so that any first N mix every package rather than the alphabet's first few."""
    rows = code_prompts(Path(sysconfig.get_paths()["purelib"]), "site", None)
    rows.sort(key=lambda row: hashlib.sha1(row["id"].encode()).hexdigest())
    return rows[:limit]


def code_prompts(root: Path, prefix: str, limit: int | None) -> list[dict]:
    """HumanEval-shaped prompts (signature + docstring) under root, ids '{prefix}/{file}:{name}'."""
    rows: list[dict] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if STDLIB_SKIP & set(rel.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        classes = [c for c in tree.body if isinstance(c, ast.ClassDef) and not c.name.startswith("_")]
        funcs = [(f.name, f) for f in tree.body if isinstance(f, ast.FunctionDef)]
        funcs += [(f"{c.name}.{f.name}", f) for c in classes for f in c.body if isinstance(f, ast.FunctionDef)]
        for name, f in funcs:
            doc = ast.get_docstring(f, clean=False)
            if f.name.startswith("_") or not doc or len(doc) < 60:
                continue
            stub = ast.FunctionDef(
                name=f.name, args=f.args, body=[ast.Expr(ast.Constant(doc))], decorator_list=[], returns=f.returns
            )
            text = ast.unparse(ast.fix_missing_locations(stub)) + "\n"
            rows.append({"id": f"{prefix}/{rel.as_posix()}:{name}", "messages": [{"role": "user", "content": text}]})
            if len(rows) == limit:
                return rows
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip", type=int, default=216, help="ShareGPT records passed over (216: the held-out ones)")
    results = ROOT / "docs/results"

    def found(pattern: str) -> list[str]:  # the committed reply files matching pattern, by directory name
        return [str(p) for p in sorted(results.glob(pattern), key=lambda p: p.parent.name)]

    # every GPU run's and every CPU regeneration's replies (gpu-burst, gpu-burst-2, ...; code-cpu, code-cpu-2, ...),
    # found rather than listed, so a new one counts as answered without an edit here
    committed = [
        *found("gpu-burst*/regen_gpu.jsonl.gz"),
        str(results / "decoding/word-problems/replies.jsonl.gz"),
        *found("code-cpu*/replies.jsonl.gz"),
    ]
    ap.add_argument("--replies", nargs="+", default=committed, help="replies regenerated already (JSONL or .jsonl.gz)")
    ap.add_argument("--code", type=int, default=0, help="add up to N standard-library code-completion prompts")
    ap.add_argument(
        "--code-site", type=int, default=0, help="add up to N code-completion prompts from the venv's packages"
    )
    ap.add_argument("--math", type=int, default=0, help="add the first N template word problems (data.word_problems)")
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
    done = {row["id"] for r in args.replies for _, row in iter_jsonl(r)}
    eligible, skipped = plan([cv for cv in convs if cv["id"] not in done], tok, 256)
    made = stdlib_code_prompts(args.code) if args.code else []
    made += site_code_prompts(args.code_site) if args.code_site else []
    made += word_problems(args.math) if args.math else []
    made = [{"id": row["id"], "messages": row["messages"]} for row in made if row["id"] not in done]
    with gzip.open(c / "prompts.jsonl.gz", "wt", encoding="utf-8") as f:
        for rid, prompt, _ in eligible:
            f.write(json.dumps({"id": rid, "messages": prompt}, ensure_ascii=False) + "\n")
        for row in made:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    with gzip.open(c / "replies_prev.jsonl.gz", "wb") as dst:
        for r in args.replies:
            with (gzip.open if r.endswith(".gz") else open)(r, "rb") as src:
                shutil.copyfileobj(src, dst)
    if not (dev / "whl").is_dir():
        raise SystemExit(f"{dev / 'whl'}: no wheels; download them first (tools/gpu_burst/README.md)")
    shutil.copytree(dev / "whl", c / "whl")
    sizes = {p.relative_to(dev).as_posix(): p.stat().st_size for p in dev.rglob("*") if p.is_file()}
    counts = {"prompts": len(eligible), "code_and_math_prompts": len(made), "already_done": len(done)}
    print(json.dumps({**counts, "skipped": dict(skipped), "bytes": sizes}, indent=1))


if __name__ == "__main__":
    main()
