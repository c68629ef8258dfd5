"""The eval's prompt sets as rows: z-lab dflash's benchmark sets and wording, HF datasets, JSONL prompt files."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path

from data import assets
from data.conversations import iter_jsonl

# The wording of z-lab dflash's benchmark (dflash/benchmark.py): the math sets end in this request, HumanEval is
# wrapped in a request and a python fence; MBPP, MT-Bench and Alpaca are asked as the set writes them.
STEP_BY_STEP = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_HEAD = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
HUMANEVAL_TAIL = "\n```"
# z-lab's subset of N prompts: Python's random.shuffle, seeded 0, of the whole set, then its first N (the set as
# it is where N covers it). The same permutation as theirs wherever the rows come in the hub's order.
SUBSET_SEED = 0
ZLAB = ("gsm8k", "math500", "humaneval", "mbpp", "mtbench")  # the sets of z-lab's published tables
STYLES = ("zlab", "raw")
ID_KEYS = ("input_ids", "token_ids", "prompt_ids")  # raw token ids: no chat template
TEXT_KEYS = ("prompt", "question", "problem", "instruction")


class Unavailable(RuntimeError):
    """A set that cannot be loaded on this machine: no package ships it and the hub is out of reach (or refused)."""


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """A named set: where its rows come from (HF field names either way) and how a row reads as user turns."""

    hub: tuple[str, ...]  # datasets.load_dataset's path (and config name)
    split: str
    count: int  # the prompts (questions) z-lab's published runs take
    zlab: Callable[[dict], list[str]]  # a row's user turns in z-lab's wording
    raw: Callable[[dict], str]  # the row's bare text (the earlier wording of this eval)
    row_id: Callable[[int, dict], str]
    offline: Callable[[], list[dict]] | None = None  # the same rows from a package-shipped file
    source: str = ""  # that package and file

    @property
    def hub_name(self) -> str:
        return f"{':'.join(self.hub)} (split {self.split})"


def _boxed(field: str) -> Callable[[dict], list[str]]:
    return lambda r: [r[field] + STEP_BY_STEP]


def _alpaca(r: dict) -> list[str]:
    return [f"{r['instruction']}\n\nInput:\n{r['input']}" if r.get("input") else r["instruction"]]


def _mtbench_rows() -> list[dict]:
    return [{"prompt_id": r["question_id"], "category": r["category"], "prompt": r["turns"]} for r in assets.mtbench()]


def _aime_rows() -> list[dict]:
    return [{"problem": r["question"], "answer": r["answer"]} for r in assets.aime2025()]


def _asset(name: str) -> str:
    a = assets.ASSETS[name]
    return f"{a.package}=={a.version}: {a.member}"


SETS = {
    "gsm8k": PromptSet(
        ("openai/gsm8k", "main"),
        "test",
        128,
        _boxed("question"),
        lambda r: r["question"],
        lambda i, r: f"gsm8k/{i}",
        assets.gsm8k,
        _asset("gsm8k"),
    ),
    "math500": PromptSet(
        ("HuggingFaceH4/MATH-500",), "test", 128, _boxed("problem"), lambda r: r["problem"], lambda i, r: f"math500/{i}"
    ),
    "humaneval": PromptSet(
        ("openai/openai_humaneval",),
        "test",
        164,
        lambda r: [HUMANEVAL_HEAD + r["prompt"] + HUMANEVAL_TAIL],
        lambda r: r["prompt"],
        lambda i, r: r["task_id"],
        assets.humaneval,
        _asset("humaneval"),
    ),
    "mbpp": PromptSet(
        ("google-research-datasets/mbpp", "sanitized"),
        "test",
        128,
        lambda r: [r["prompt"]],
        lambda r: r["prompt"],
        lambda i, r: f"mbpp/{r.get('task_id', i)}",
    ),
    "mtbench": PromptSet(
        ("HuggingFaceH4/mt_bench_prompts",),
        "train",
        80,
        lambda r: list(r["prompt"]),
        lambda r: r["prompt"][0],
        lambda i, r: f"mtbench/{r.get('prompt_id', i)}",
        _mtbench_rows,
        _asset("mtbench"),
    ),
    "aime25": PromptSet(
        ("MathArena/aime_2025",),
        "train",
        30,
        _boxed("problem"),
        lambda r: r["problem"],
        lambda i, r: f"aime25/{i}",
        _aime_rows,
        f"{_asset('aime2025-I')} and aime2025-II.jsonl",
    ),
    "alpaca": PromptSet(
        ("tatsu-lab/alpaca",), "train", 128, _alpaca, lambda r: _alpaca(r)[0], lambda i, r: f"alpaca/{i}"
    ),
}


def set_rows(name: str, offline: bool = False) -> tuple[list[dict], str]:
    """(rows with the hub's field names, where they came from) of a named set: the package-shipped file where one
    ships it, else the hub through `datasets` (Unavailable where that fails, or at once with offline=True)."""
    ps = SETS[name]
    if ps.offline is not None:
        return ps.offline(), ps.source
    if offline:
        raise Unavailable(f"{name}: online only ({ps.hub_name} on the HF hub; no package ships it), and offline")
    import datasets

    try:
        check_hub_reachable(ps.hub_name)
        ds = datasets.load_dataset(*ps.hub, split=ps.split)
    except Exception as e:  # no network, no such dataset, a hub error: the set is left out, said why
        raise Unavailable(f"{name}: online only, and {ps.hub_name} could not be loaded: {type(e).__name__}: {e}") from e
    return [dict(r) for r in ds], f"HF hub {ps.hub_name}"


HUB_PROBE_S = 5.0  # the hub answers a TCP connect in well under a second where it can be reached at all


def check_hub_reachable(what: str) -> None:
    """Unavailable within HUB_PROBE_S where the HF hub's host takes no connection: `datasets` would retry for half a
    minute before its ConnectionError. Skipped behind a proxy or a custom HF_ENDPOINT, where a direct connect
    proves nothing; HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set means no connection at all."""
    import os
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(k) not in (None, "", "0") for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        raise Unavailable(f"{what}: on the HF hub, and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set")
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_ENDPOINT")):
        return
    host = urlparse("https://huggingface.co").hostname
    try:
        socket.create_connection((host, 443), timeout=HUB_PROBE_S).close()
    except OSError as e:
        raise Unavailable(f"{what}: on the HF hub, which cannot be reached ({host}:443: {e})") from None


def subset(rows: list, limit: int | None, style: str = "zlab") -> list[tuple[int, object]]:
    """(index in the set, row) of the rows a run takes: all of them, or `limit` of them: z-lab's (a shuffle seeded
    SUBSET_SEED, then the first `limit`) in the zlab style, the first `limit` in the raw one."""
    indexed = list(enumerate(rows))
    if limit is None or limit >= len(indexed):
        return indexed
    if style == "zlab":
        random.Random(SUBSET_SEED).shuffle(indexed)  # the permutation depends only on the length
    return indexed[:limit]


def named_prompts(name: str, limit: int | None = None, *, style: str = "zlab", offline: bool = False) -> list[dict]:
    """Rows {id, text} of a named set. zlab style: z-lab's wording and subset, every turn of a multi-turn item a
    prompt of its own: turn t > 1 is {id: ITEM/turnT, text, earlier_turns: [the user turns before it]}, asked
    after the target's own answers to those (`infer.eval` decodes them first). raw: the bare text, the first turn
    only, the first `limit` items."""
    if style not in STYLES:
        raise ValueError(f"prompt style {style!r}: expected one of {STYLES}")
    ps = SETS[name]
    items, _ = set_rows(name, offline)
    rows = []
    for i, item in subset(items, limit, style):
        rid = ps.row_id(i, item)
        turns = ps.zlab(item) if style == "zlab" else [ps.raw(item)]
        rows.append({"id": rid, "text": turns[0]})
        for t in range(2, len(turns) + 1):
            rows.append({"id": f"{rid}/turn{t}", "text": turns[t - 1], "earlier_turns": turns[: t - 1]})
    return rows


def _ids(value, where: str, key: str) -> list[int]:
    ok = isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    if not ok:
        raise ValueError(f"{where}: key {key!r} must be a non-empty list of integer token ids, got {str(value)[:60]}")
    return value


def _messages(value, where: str) -> list[dict]:
    turn = lambda m: isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
    if not (isinstance(value, list) and value and all(map(turn, value))):
        raise ValueError(
            f"{where}: key 'messages' must be a non-empty list of {{'role': str, 'content': str}}, got "
            f"{str(value)[:60]}"
        )
    return value


def parse_row(r, where: str) -> dict:
    """One prompt-file or dataset row as {prompt_ids} (raw ids: `input_ids`, `token_ids` or `prompt_ids`; no
    template), {messages} (a chat list) or {text} (`prompt`, `question`, `problem`, `instruction`, or the first of
    `turns`); a ValueError naming `where` (file:line) and the key on a row that has none or a bad one."""
    if not isinstance(r, dict):
        raise ValueError(f"{where}: expected a JSON object with prompt, messages, input_ids or token_ids")
    for key in ID_KEYS:
        if key in r:
            return {"prompt_ids": _ids(r[key], where, key)}
    if "messages" in r:
        return {"messages": _messages(r["messages"], where)}
    for key in (*TEXT_KEYS, "turns"):
        if key in r:
            text = r[key][0] if key == "turns" and isinstance(r[key], list) and r[key] else r[key]
            if not isinstance(text, str) or not text:
                raise ValueError(f"{where}: key {key!r} must be a non-empty string, got {str(r[key])[:60]}")
            return {"text": text}
    raise ValueError(f"{where}: no prompt, messages, input_ids or token_ids in this row (its keys: {sorted(r)})")


def jsonl_prompts(path: Path, limit: int | None = None) -> list[dict]:
    """Rows of a JSONL prompt file (`parse_row`); a row without an `id` is named FILE_STEM/ROW_INDEX."""
    rows = []
    for lineno, r in iter_jsonl(path):
        if limit is not None and len(rows) >= limit:
            break
        rid = r.get("id", f"{path.stem}/{lineno - 1}") if isinstance(r, dict) else None
        rows.append({"id": rid, **parse_row(r, f"{path}:{lineno}")})
    return rows


def _hf_spec(spec: str) -> tuple[str, str | None, str | None]:
    """'ORG/NAME[:SPLIT]' or 'ORG/NAME:CONFIG:SPLIT' (or a local directory for ORG/NAME) -> (path, config, split)."""
    parts = spec.split(":")
    if len(parts) > 3 or not parts[0]:
        raise ValueError(f"--dataset hf:{spec}: expected hf:ORG/NAME[:SPLIT] or hf:ORG/NAME:CONFIG:SPLIT")
    if len(parts) == 3:
        return parts[0], parts[1] or None, parts[2] or None
    return parts[0], None, parts[1] if len(parts) == 2 and parts[1] else None


def _one_split(ds, spec: str, split: str | None):
    """A Dataset from what datasets returned: a DatasetDict's `split`, else its 'test' or its only split."""
    if not hasattr(ds, "keys"):
        return ds
    name = split or ("test" if "test" in ds else next(iter(ds)) if len(ds) == 1 else None)
    if name not in ds:
        raise ValueError(f"--dataset hf:{spec}: give a split, one of {sorted(ds)} (hf:NAME:SPLIT)")
    return ds[name]


def hf_prompts(spec: str, limit: int | None = None, *, offline: bool = False) -> list[dict]:
    """Rows (`parse_row`) of an HF dataset: a hub name, or a local directory written by `Dataset.save_to_disk` or
    holding parquet/JSON files (read by `datasets.load_dataset`). A hub name is Unavailable at once with offline=True,
    and in one line where the hub cannot be reached or refuses it."""
    import datasets

    path, config, split = _hf_spec(spec)
    local = Path(path)
    if local.is_dir() and any((local / f).is_file() for f in ("state.json", "dataset_dict.json")):
        ds = datasets.load_from_disk(str(local))
    elif local.is_dir():
        ds = datasets.load_dataset(path, config, split=split) if split else datasets.load_dataset(path, config)
    else:
        if offline:
            raise Unavailable(f"hf:{spec}: on the HF hub, and --offline (a local dataset directory works offline)")
        try:
            check_hub_reachable(f"hf:{spec}")
            ds = datasets.load_dataset(path, config, split=split) if split else datasets.load_dataset(path, config)
        except Unavailable:
            raise
        except Exception as e:  # no network, no such dataset, no access: one line, not the client's traceback
            reason = (str(e).strip().splitlines() or [""])[0][:300]
            raise Unavailable(f"hf:{spec}: could not be loaded from the HF hub: {type(e).__name__}: {reason}") from e
    ds = _one_split(ds, spec, split)
    n = len(ds) if limit is None else min(limit, len(ds))
    out = []
    for i in range(n):
        r = ds[i]
        out.append({"id": str(r.get("id", f"{local.name}/{i}")), **parse_row(r, f"hf:{spec} row {i}")})
    return out


# --- held-out prompts: past the ones that chose a checkpoint ----------------------------------------------------------


def held_out_order(items: int, skip: int) -> list[int]:
    """Item indices in z-lab's shuffled order (`subset`: random.shuffle seeded SUBSET_SEED, whose permutation
    depends only on the count) without the first `skip` of that order and of the file's order: disjoint from every
    `--limit N` selection with N <= skip in either prompt style."""
    order = list(range(items))
    random.Random(SUBSET_SEED).shuffle(order)
    used = set(range(min(skip, items))) | set(order[:skip])
    return [i for i in order if i not in used]


def group_items(rows: list[dict]) -> list[list[dict]]:
    """Rows grouped into items: a later turn (`earlier_turns`) belongs with the rows before it."""
    items: list[list[dict]] = []
    for r in rows:
        if "earlier_turns" in r and items:
            items[-1].append(r)
        else:
            items.append([r])
    return items


def held_out(rows: list[dict], named: bool, skip: int, limit: int | None) -> tuple[list[dict], dict]:
    """The rows of up to `limit` items past the first `skip` (a named set: in `held_out_order`, so a random sample
    disjoint from both styles' first `skip`; a file: its rows after the first `skip`), and how they were chosen."""
    if named:
        items = group_items(rows)
        order = held_out_order(len(items), skip)
        chosen = order[:limit] if limit is not None else order
        out = [r for i in chosen for r in items[i]]
        rule = f"z-lab's order (shuffle seeded {SUBSET_SEED}) without the first {skip} of it and of file order"
        return out, {"items_in_set": len(items), "items_held_out": len(order), "items": chosen, "order": rule}
    end = None if limit is None else skip + limit
    out = rows[skip:end]
    return out, {"items_in_set": len(rows), "items": list(range(skip, skip + len(out))), "order": "file"}
