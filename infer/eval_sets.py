"""The prompts an evaluation decodes: a --dataset value as sets, each set's rows (named sets in z-lab's wording,
hf:ORG/NAME, JSONL), MT-Bench's later turns asked after the target's own answers, and the rows as token ids under
the chat template. Shared by `python -m infer.eval`, `python -m infer.teacher_forced` and the end-of-run eval."""

from __future__ import annotations

import json
from pathlib import Path

from data.prompt_sets import SETS, ZLAB, hf_prompts, jsonl_prompts, named_prompts
from dflash_model.tokenizer import chat_prompt_ids
from infer.plain import greedy_replies

DATASETS = tuple(SETS)


def dataset_names(value: str) -> list[str]:
    """--dataset as the sets it runs: 'zlab' is z-lab's five, a comma list each of its parts, else the one value."""
    if value == "zlab":
        return list(ZLAB)
    return [v for v in value.split(",") if v] or [value]


def dataset_messages(name: str, limit: int | None = None, *, style: str = "raw", offline: bool = False) -> list[dict]:
    """Rows [{id, text} | {id, messages} | {id, prompt_ids}] of a named set (data.prompt_sets.SETS), an HF dataset
    (hf:ORG/NAME[:SPLIT], or a local dataset directory) or a JSONL file (data.prompt_sets.parse_row).

    style zlab: z-lab dflash's wording and subset; MT-Bench's second turns are rows with `earlier_turns`, asked
    after the target's own answers (`answer_earlier_turns`). raw (the default of this function, what the earlier
    numbers of this project used): the bare text, first turns only, the first `limit` items.
    """
    if name in SETS:
        return named_prompts(name, limit, style=style, offline=offline)
    if name.startswith("hf:"):
        return hf_prompts(name[3:], limit, offline=offline)
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"--dataset {name!r}: expected one of {DATASETS}, zlab, hf:ORG/NAME[:SPLIT] or a .jsonl file")
    return jsonl_prompts(path, limit)


def dataset_source(name: str) -> str:
    """Where a --dataset's rows come from, for eval.json."""
    if name in SETS:
        return SETS[name].source or f"HF hub {SETS[name].hub_name}"
    return name


def conversation(turns: list[str], answers: dict[str, str]) -> list[dict]:
    """User turns with the target's answers to all but the last between them (`answers`: the json of a
    conversation ending in a user turn -> the answer to it)."""
    messages: list[dict] = []
    for turn in turns[:-1]:
        messages.append({"role": "user", "content": turn})
        messages.append({"role": "assistant", "content": answers[json.dumps(messages)]})
    return [*messages, {"role": "user", "content": turns[-1]}]


def earlier_conversations(rows: list[dict], level: int, answers: dict[str, str]) -> dict[str, dict]:
    """{json of the messages: {id, messages}} of the distinct conversations through user turn `level` + 1 that rows
    with more than `level` earlier turns need answered (the turns before it written with their `answers`); the id
    names the first row that needs it."""
    out: dict[str, dict] = {}
    for r in rows:
        turns = r.get("earlier_turns", [])
        if len(turns) > level:
            messages = conversation(turns[: level + 1], answers)
            out.setdefault(json.dumps(messages), {"id": f"{r['id']}/earlier{level + 1}", "messages": messages})
    return out


def answer_earlier_turns(
    model, tokenizer, rows: list[dict], *, max_new_tokens: int, stop_ids=(), thinking=False, batch_size=1, bar=None
):
    """Rows with `earlier_turns` made chats: each earlier user turn followed by the target's own answer to it
    (plain greedy decoding, up to max_new_tokens, the text without special tokens), then the row's turn. This is
    z-lab's MT-Bench turn 2, there asked after the speculative decode's answer, the same text under greedy
    decoding. The answers of one turn depth are decoded together, `batch_size` at a time (`bar`, a tqdm bar, counts
    them): a set's earlier turns at 512 tokens are minutes of plain decoding on a CPU."""
    if not any("earlier_turns" in r for r in rows):
        return rows
    if tokenizer is None:
        raise ValueError("a multi-turn set needs the target's tokenizer to write its answers back into the chat")
    answers: dict[str, str] = {}
    depth = max(len(r.get("earlier_turns", [])) for r in rows)
    for level in range(depth):
        todo = earlier_conversations(rows, level, answers)
        if bar is not None:
            bar.total = (bar.total or 0) + len(todo)
            bar.refresh()
        prompts = [chat_prompt_ids(tokenizer, c["messages"], thinking=thinking) for c in todo.values()]
        replies = greedy_replies(
            model, prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids, batch_size=batch_size, bar=bar
        )
        for key, reply in zip(todo, replies):
            answers[key] = tokenizer.decode(reply, skip_special_tokens=True)
    out = []
    for r in rows:
        if "earlier_turns" in r:
            r = {"id": r["id"], "messages": conversation([*r["earlier_turns"], r["text"]], answers)}
        out.append(r)
    return out


def encode(rows: list[dict], tokenizer, thinking: bool = False) -> list[list[int]]:
    out = []
    for r in rows:
        if "prompt_ids" in r:
            out.append(r["prompt_ids"])
            continue
        if tokenizer is None:
            raise ValueError("this target has no tokenizer: the dataset must give token ids (input_ids)")
        if "earlier_turns" in r:
            raise ValueError(f"prompt {r['id']}: a later turn, encoded before its earlier turns were answered")
        out.append(chat_prompt_ids(tokenizer, r.get("messages", r.get("text")), thinking=thinking))
    return out
