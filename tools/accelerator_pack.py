"""Stage what a training job on an accelerator machine needs (scripts/accelerator_run.sh; docs/accelerator.md) in
parts that each fit one transfer, and put it back together on the machine.

    .venv/bin/python tools/accelerator_pack.py [--drafter DIR] [--sharegpt] [--code N] [--code-site N] [--math N]
        [--skip 216] [--replies FILE ...] [--wheels .dev/whl] [--part-mb 62] [--out .dev/stage]
    python3 tools/accelerator_pack.py --unpack STAGE        # on the machine, with every part copied into STAGE

Staged: the target's files from the asset cache (the SmolLM2 GGUF and its converted tokenizer, mtimes kept, so the
cache keys match), the Python wheels the machine's image lacks (`--wheels`), the drafter the run starts from
(`--drafter`), and with any of --sharegpt, --code, --code-site, --math the prompts to regenerate replies to and the
replies regenerated already (`--replies`, trained on beside the new ones). The prompts: ShareGPT first turns of at
most 256 tokens under the chat template after --skip records, in regenerate's plan order, then code-completion
prompts from the standard library and from the venv's packages (data.code_prompts) and template word problems
(data.word_problems); each less the ids that have a reply already.

Each part folder (`OUT/part0`, `part1`, ...) holds at most --part-mb MB; a larger file is split into chunks across
parts. The last part holds manifest.json: each file's chunks, size, sha256 and mtime. `--unpack` reads only the
standard library (it runs before the wheels are installed), names a missing or damaged chunk or file, and writes each
file beside its place and renames it there only once its size and sha256 match: nothing partial is left.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = "manifest.json"


def committed_replies() -> list[str]:
    """Every reply file committed under docs/results/: the accelerator runs', the CPU regenerations' and the word
    problems', found rather than listed, so a new one counts as answered without an edit here."""
    results = ROOT / "docs/results"

    def found(pattern: str) -> list[str]:  # by directory name: gpu-burst, gpu-burst-2, ...
        return [str(p) for p in sorted(results.glob(pattern), key=lambda p: p.parent.name)]

    return [
        *found("gpu-burst*/regen_gpu.jsonl.gz"),
        str(results / "decoding/word-problems/replies.jsonl.gz"),
        *found("code-cpu*/replies.jsonl.gz"),
    ]


def write_prompts(args, files: Path) -> dict:
    """prompts.jsonl.gz and replies_prev.jsonl.gz under files/; returns their counts."""
    from data.assets import smollm2_gguf
    from data.code_prompts import site_code_prompts, stdlib_code_prompts
    from data.conversations import iter_jsonl, load_conversations
    from data.word_problems import word_problems
    from dflash_model.tokenizer import load_tokenizer
    from train.regenerate import plan

    done = {row["id"] for r in args.replies for _, row in iter_jsonl(r)}
    eligible, skipped = [], {}
    if args.sharegpt:
        convs, _ = load_conversations("sharegpt", skip=args.skip, require_assistant=False)
        eligible, skipped = plan([cv for cv in convs if cv["id"] not in done], load_tokenizer(smollm2_gguf()), 256)
    made = stdlib_code_prompts(args.code) if args.code else []
    made += site_code_prompts(args.code_site) if args.code_site else []
    made += word_problems(args.math) if args.math else []
    made = [{"id": row["id"], "messages": row["messages"]} for row in made if row["id"] not in done]
    with gzip.open(files / "prompts.jsonl.gz", "wt", encoding="utf-8") as f:
        for rid, prompt, _ in eligible:
            f.write(json.dumps({"id": rid, "messages": prompt}, ensure_ascii=False) + "\n")
        for row in made:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    with gzip.open(files / "replies_prev.jsonl.gz", "wb") as dst:
        for r in args.replies:
            with (gzip.open if r.endswith(".gz") else open)(r, "rb") as src:
                shutil.copyfileobj(src, dst)
    counts = {"prompts": len(eligible), "code_and_math_prompts": len(made), "already_done": len(done)}
    return {**counts, "skipped": dict(skipped)}


def logical_files(args, tmp: Path) -> dict[str, Path]:
    """Staged name -> local file. Names under cache/ go to the machine's asset cache, the rest under STAGE/files/."""
    from data.assets import smollm2_gguf
    from dflash_model.files import cache_root
    from dflash_model.tokenizer import converted_tokenizer_dir, load_tokenizer

    gguf = smollm2_gguf()
    load_tokenizer(gguf)  # builds and caches the converted tokenizer if this machine has not yet
    tok_dir = converted_tokenizer_dir(gguf)
    files: dict[str, Path] = {}
    for p in [gguf, *sorted(q for q in tok_dir.rglob("*") if q.is_file())]:
        files["cache/" + p.resolve().relative_to(cache_root().resolve()).as_posix()] = p
    if args.drafter:
        for p in sorted(q for q in Path(args.drafter).rglob("*") if q.is_file() and q.name != "README.md"):
            files["drafter/" + p.relative_to(args.drafter).as_posix()] = p
    if args.wheels:
        wheels = sorted(Path(args.wheels).glob("*.whl"))
        if not wheels:
            raise SystemExit(f"{args.wheels}: no wheels (docs/accelerator.md says how to download them)")
        files.update({f"whl/{p.name}": p for p in wheels})
    if args.sharegpt or args.code or args.code_site or args.math:
        print(json.dumps(write_prompts(args, tmp)))
        files.update({name: tmp / name for name in ("prompts.jsonl.gz", "replies_prev.jsonl.gz")})
    return files


def is_stage(path: Path) -> bool:
    """Whether `path` holds nothing but part folders (an earlier stage, which --out may replace)."""
    return all(p.is_dir() and (p.name.startswith("part") or p.name == "tmp") for p in path.iterdir())


def pack(args) -> None:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise SystemExit(f"error: --out {out} is a file, not a directory")
    if out.exists() and not is_stage(out):
        raise SystemExit(f"error: --out {out} holds files other than part folders: refusing to replace it")
    shutil.rmtree(out, ignore_errors=True)
    tmp = out / "tmp"
    tmp.mkdir(parents=True)
    limit = int(args.part_mb * 1_000_000)
    manifest, part, used = {}, 0, 0
    for name, path in logical_files(args, tmp).items():
        data, chunks = path.read_bytes(), []  # staged files are at most a few hundred MB
        while True:  # fill the current part, open the next when it is full; empty files take one empty chunk
            if used >= limit:
                part, used = part + 1, 0
            piece = data[: limit - used]
            data = data[len(piece) :]
            chunk = f"{len(manifest):04d}.{len(chunks)}"
            (out / f"part{part}").mkdir(exist_ok=True)
            (out / f"part{part}" / chunk).write_bytes(piece)
            chunks.append(chunk)
            used += len(piece)
            if not data:
                break
        whole = path.read_bytes()
        manifest[name] = {
            "chunks": chunks,
            "bytes": len(whole),
            "sha256": hashlib.sha256(whole).hexdigest(),
            "mtime": int(path.stat().st_mtime),
        }
    (out / f"part{part}").mkdir(exist_ok=True)
    (out / f"part{part}" / MANIFEST).write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(tmp)
    sizes = {p.name: sum(f.stat().st_size for f in p.iterdir()) for p in sorted(out.iterdir())}
    print(json.dumps({"files": len(manifest), "part_bytes": sizes}, indent=1))


def unpack(stage: Path) -> None:
    """Join the chunks of every staged file: cache/ names into $DFLASH_CACHE, the rest into STAGE/files/. Every chunk
    is found and every file's size and sha256 checked before anything is written in its place."""
    manifest_path = stage / MANIFEST
    if not manifest_path.is_file():
        raise SystemExit(
            f"error: {manifest_path}: no manifest (copy every part's files into {stage}, the last "
            "part's manifest.json with them)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        entries = [(name, e["chunks"], int(e["bytes"]), e["sha256"], int(e["mtime"])) for name, e in manifest.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SystemExit(
            f"error: {manifest_path}: not a manifest with chunks, bytes, sha256 and mtime per file "
            f"({type(e).__name__}: {e}); stage again with this version of the tool"
        ) from None
    missing = sorted(c for _, chunks, *_ in entries for c in chunks if not (stage / c).is_file())
    if missing:
        raise SystemExit(
            f"error: {stage}: {len(missing)} chunk(s) missing, e.g. {', '.join(missing[:5])}: copy every "
            "part's files into it"
        )
    cache = Path(os.environ.get("DFLASH_CACHE", "~/.cache/dflash-jax")).expanduser()
    for name, chunks, size, sha256, mtime in entries:
        dest = cache / name.removeprefix("cache/") if name.startswith("cache/") else stage / "files" / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(dest.name + ".partial")
        digest, written = hashlib.sha256(), 0
        try:
            with partial.open("wb") as f:
                for chunk in chunks:
                    piece = (stage / chunk).read_bytes()
                    digest.update(piece)
                    written += len(piece)
                    f.write(piece)
            if written != size or digest.hexdigest() != sha256:
                raise SystemExit(
                    f"error: {name}: its chunks ({', '.join(chunks)}) join to {written} bytes with sha256 "
                    f"{digest.hexdigest()[:12]}..., the manifest says {size} bytes, {sha256[:12]}...: a part was "
                    "damaged or truncated in transfer; copy it again"
                )
            os.utime(partial, (mtime, mtime))
            os.replace(partial, dest)
        finally:
            partial.unlink(missing_ok=True)
    print(f"{len(entries)} files unpacked, each size and sha256 checked", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--unpack", metavar="STAGE", help="on the machine: join the parts copied into STAGE")
    ap.add_argument("--out", default=str(ROOT / ".dev/stage"), help="where the parts are written")
    ap.add_argument("--part-mb", type=float, default=62.0, help="the most one part holds, in MB")
    ap.add_argument("--wheels", default=str(ROOT / ".dev/whl"), help="wheels to install there; '' for none")
    ap.add_argument("--drafter", help="the drafter directory the run starts from (drafter.init)")
    ap.add_argument("--sharegpt", action="store_true", help="stage ShareGPT first turns to regenerate replies to")
    ap.add_argument("--skip", type=int, default=216, help="ShareGPT records passed over (216: the held-out ones)")
    ap.add_argument("--code", type=int, default=0, help="add up to N standard-library code-completion prompts")
    ap.add_argument("--code-site", type=int, default=0, help="add up to N code-completion prompts from the venv")
    ap.add_argument("--math", type=int, default=0, help="add the first N template word problems")
    ap.add_argument("--replies", nargs="+", default=None, help="replies regenerated already (JSONL or .jsonl.gz)")
    args = ap.parse_args(argv)
    if args.unpack:
        return unpack(Path(args.unpack))
    sys.path.insert(0, str(ROOT))
    args.replies = committed_replies() if args.replies is None else args.replies
    pack(args)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from dflash_model.cli import run_main  # the standard library only, as --unpack needs

    run_main(main)
