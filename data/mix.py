"""Build a training JSONL from parts of reply files: the new replies of a stage, plus a replay sample of the ones it
trained on before so other kinds of text are not forgotten. Each part is one or more JSONL files (gzipped if named
.gz) read as one list of lines; with a seed the list is shuffled (`random.Random(seed)`), then `skip` lines are
dropped and `take` kept. The parts are concatenated and shuffled with --seed. Lines are copied byte for byte, so the
mix is reproducible from the command alone.

    python -m data.mix OUT PART [PART ...] [--seed 0]
    PART = FILE[+FILE...][:seed=S][:skip=N][:take=N]

The continued training stages of the shipped SmolLM2 drafter (docs/results/code-cpu*/README.md) were mixed so.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

from dflash_model.files import atomic_writer


@dataclass(frozen=True)
class Part:
    files: tuple[str, ...]
    seed: int | None = None
    skip: int = 0
    take: int | None = None


def parse_part(spec: str) -> Part:
    """`a.jsonl+b.jsonl.gz:seed=1:skip=450:take=450` -> Part; an unknown key or a bad number is an error naming it."""
    head, *opts = spec.split(":")
    files = tuple(f for f in head.split("+") if f)
    if not files:
        raise ValueError(f"mix part {spec!r}: no file")
    fields: dict[str, int] = {}
    for opt in opts:
        key, _, value = opt.partition("=")
        if key not in ("seed", "skip", "take"):
            raise ValueError(f"mix part {spec!r}: unknown option {key!r} (seed, skip, take)")
        try:
            fields[key] = int(value)
        except ValueError:
            raise ValueError(f"mix part {spec!r}: {key}={value!r} is not an integer") from None
        if fields[key] < 0:
            raise ValueError(f"mix part {spec!r}: {key} must be >= 0, got {fields[key]}")
    return Part(files, **fields)


def _lines(path: str) -> list[str]:
    """The non-blank lines of a JSONL file, each ending in a newline; a line that is not JSON is an error naming
    file:line."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"mix: no such file {path}")
    with gzip.open(p, "rt", encoding="utf-8") if p.suffix == ".gz" else p.open(encoding="utf-8") as f:
        out = []
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg}") from e
            out.append(line if line.endswith("\n") else line + "\n")
    return out


def part_lines(part: Part) -> list[str]:
    lines = [line for f in part.files for line in _lines(f)]
    if part.seed is not None:
        random.Random(part.seed).shuffle(lines)
    end = None if part.take is None else part.skip + part.take
    if end is not None and end > len(lines):
        raise ValueError(f"mix part {'+'.join(part.files)}: skip {part.skip} + take {part.take} > {len(lines)} lines")
    return lines[part.skip : end]


def _shuffled(chunks: list[list[str]], seed: int) -> list[str]:
    rows = [line for chunk in chunks for line in chunk]
    random.Random(seed).shuffle(rows)
    return rows


def mix(parts: list[Part], seed: int) -> list[str]:
    return _shuffled([part_lines(part) for part in parts], seed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("parts", nargs="+", metavar="PART")
    ap.add_argument("--seed", type=int, default=0, help="seed of the shuffle of the whole mix")
    args = ap.parse_args(argv)
    parts = [parse_part(s) for s in args.parts]
    chunks = [part_lines(p) for p in parts]  # each file read once: the counts printed below come from these
    rows = _shuffled(chunks, args.seed)
    with atomic_writer(args.out) as f:
        f.write("".join(rows).encode("utf-8"))
    for spec, chunk in zip(args.parts, chunks):
        print(f"{len(chunk):6d}  {spec}")
    print(f"{len(rows):6d}  -> {args.out}")
    return 0


if __name__ == "__main__":
    from dflash_model.cli import run_main

    raise SystemExit(run_main(main))
