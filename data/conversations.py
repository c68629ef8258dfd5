"""Chat conversations for drafter training: loading, role normalisation, and chat-template tokenization with an
assistant-only loss mask."""

from __future__ import annotations

import functools
import gzip
import json
import logging
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from data.assets import sharegpt
from dflash_model.tokenizer import stop_token_ids

log = logging.getLogger(__name__)

ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
}


def normalize_record(rec, default_id: str, *, require_assistant: bool = True) -> dict | str:
    """{id, messages: [{role, content}]} of one raw record, or the reason (a short string) it is dropped.

    Accepts ShareGPT `conversations: [{from, value}]` and OpenAI-style `messages: [{role, content}]`. Rules:
    a malformed turn (not a dict, unknown role, non-string content) drops the whole record, since guessing
    which turns to keep would silently change who said what; the conversation is cut before its first empty
    turn (ShareGPT has truncated scrapes ending in empty replies); assistant turns before the first user turn
    are removed (scrapes that start mid-conversation); a record needs a user turn, followed by an assistant
    turn when `require_assistant` (training data; prompts to regenerate need none).
    """
    if not isinstance(rec, dict):
        return "malformed"
    turns = rec.get("messages", rec.get("conversations"))
    if not isinstance(turns, list):
        return "malformed"
    messages = []
    for t in turns:
        if not isinstance(t, dict):
            return "malformed"
        role = t.get("role", t.get("from"))
        content = t.get("content", t.get("value"))
        if not isinstance(role, str) or role.lower() not in ROLES or not isinstance(content, str):
            return "malformed"
        messages.append({"role": ROLES[role.lower()], "content": content})
    for i, m in enumerate(messages):
        if not m["content"].strip():
            messages = messages[:i]
            break
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        return "empty"
    messages = [m for i, m in enumerate(messages) if i >= first_user or m["role"] == "system"]
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        return "empty"
    rid = rec.get("id")
    return {"id": default_id if rid is None else str(rid), "messages": messages}


def iter_jsonl(path: str | Path) -> Iterable[tuple[int, object]]:
    """(line number, parsed object) of every non-blank line of a JSONL file, gzipped if its name ends in .gz;
    invalid JSON, a line that is not UTF-8 and a damaged gzip stream are errors naming file:line."""
    path = Path(path)
    lineno = 0
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):  # split on b"\n" only, as the files are written
                line = _utf8(raw, path, lineno)
                if line.strip():
                    yield lineno, _json(line, path, lineno)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ValueError(f"{path}:{lineno + 1}: a damaged gzip file ({e})") from None


def _utf8(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); save the file as UTF-8"
        ) from None


def _json(line: str, path: Path, lineno: int):
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from e


def load_conversations(
    source, *, limit: int | None = None, require_assistant: bool = True, skip: int = 0
) -> tuple[list[dict], Counter]:
    """Normalised conversations and the count of dropped records per reason ("malformed", "empty").

    `source`: a JSONL path, the name "sharegpt" (the packaged ShareGPT V3 set), or a list of raw records.
    `skip` raw records are passed over first, then `limit` caps the number of raw records read. Drops are logged
    as one warning with their counts.
    """
    if skip < 0:
        raise ValueError(f"skip={skip}: must be >= 0")
    if isinstance(source, str) and source == "sharegpt":
        raw = enumerate(sharegpt(None if limit is None else skip + limit), 1)
        name = "sharegpt"
    elif isinstance(source, str | Path):
        raw, name = iter_jsonl(Path(source).expanduser()), Path(source).name
    else:
        raw, name = enumerate(source, 1), "records"
    out, dropped = [], Counter()
    for n, (lineno, rec) in enumerate(raw, -skip):
        if n < 0:
            continue
        if limit is not None and n >= limit:
            break
        res = normalize_record(rec, default_id=f"{name}:{lineno}", require_assistant=require_assistant)
        if isinstance(res, str):
            dropped[res] += 1
        else:
            out.append(res)
    if dropped:
        log.warning(
            "%s: dropped %d of %d records (%s)",
            name,
            sum(dropped.values()),
            len(out) + sum(dropped.values()),
            dict(dropped),
        )
    return out, dropped


def _render(tok, messages: Sequence[dict], generation_prompt: bool, thinking: bool) -> str:
    return tok.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=generation_prompt, enable_thinking=thinking
    )


@functools.lru_cache(maxsize=8)
def _end_markers(tok) -> frozenset[int]:
    # Cached: stop_token_ids builds the whole vocab dict, which costs more than tokenizing a conversation.
    return frozenset(stop_token_ids(tok))


def _span_by_prefix(full: list[int], header: list[int], through: list[int], ends: set[int]):
    """[start, stop) of one assistant turn if both renders are token prefixes of the full conversation."""
    if full[: len(header)] != header or full[: len(through)] != through or len(through) <= len(header):
        return None
    start, stop = len(header), len(through)
    # The template's glue after the end-of-turn marker (ChatML's "\n") is not the model's output.
    last_end = max((j for j in range(start, stop) if full[j] in ends), default=None)
    return start, (last_end + 1 if last_end is not None else stop)


def _span_by_offsets(text: str, offsets, ids: list[int], content: str, cursor: int, ends: set[int]):
    """[start, stop) of the tokens covering `content` found in `text` at or after char `cursor`, plus the
    end-of-turn marker right after it; and the new cursor. Used where the template renders a turn differently
    in the full conversation than as the last message (Qwen3 drops the empty think block of past turns)."""
    for needle in (content, content.strip()):
        at = text.find(needle, cursor) if needle else -1
        if at >= 0:
            break
    else:
        return None, cursor
    lo, hi = at, at + len(needle)
    covered = [j for j, (s, e) in enumerate(offsets) if e > lo and s < hi]
    if not covered:
        return None, cursor
    start, stop = covered[0], covered[-1] + 1
    if stop < len(ids) and ids[stop] in ends:
        stop += 1
    return (start, stop), hi


def assistant_spans(tok, messages: Sequence[dict], *, thinking: bool = False) -> tuple[list[int], list[tuple]]:
    """Token ids of the whole rendered conversation and the [start, stop) span of each assistant turn.

    A span is the turn's content plus its end-of-turn marker, without the role header. It is found by
    rendering the conversation prefix by prefix: messages[:i] with the generation prompt ends exactly where
    assistant turn i's content starts, and messages[:i+1] ends after its end-of-turn marker. Both must be
    token prefixes of the full render (a BPE merge across the boundary, or a template that renders past turns
    differently, breaks that); where they are not, the content is located by character offsets instead.
    Raises ValueError when neither works.
    """
    full_text = _render(tok, messages, False, thinking)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    texts = [full_text]
    for i in turns:
        if i == 0:
            raise ValueError("conversation starts with an assistant turn")
        texts += [_render(tok, messages[:i], True, thinking), _render(tok, messages[: i + 1], False, thinking)]
    # Texts equal to the full render (the last turn's `through`) are not tokenized twice: for the single-turn
    # conversations DFlash trains on that is one tokenization in three.
    unique = list(dict.fromkeys(texts))
    enc = dict(zip(unique, tok(unique, add_special_tokens=False)["input_ids"]))
    full, ends = list(enc[full_text]), _end_markers(tok)
    spans, offsets, cursor = [], None, 0
    for n, i in enumerate(turns):
        span = _span_by_prefix(full, list(enc[texts[1 + 2 * n]]), list(enc[texts[2 + 2 * n]]), ends)
        if span is None:
            if offsets is None:
                offsets = tok(full_text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            span, cursor = _span_by_offsets(full_text, offsets, full, messages[i]["content"], cursor, ends)
            if span is None:
                raise ValueError(f"cannot locate assistant turn {i} in the rendered conversation")
        elif full_text.startswith(texts[2 + 2 * n]):
            cursor = len(texts[2 + 2 * n])  # an offset search for a later turn starts after this one
        spans.append(span)
    return full, spans


def tokenize_conversation(tok, messages: Sequence[dict], max_len: int, thinking: bool = False) -> dict:
    """{input_ids int32 [T], loss_mask bool [T]}, T <= max_len: the chat-template rendering of `messages`
    with the loss on assistant turns only (their content and end-of-turn marker, not role headers), so the
    drafter learns the target's replies and where they stop, never to predict the user."""
    ids, spans = assistant_spans(tok, messages, thinking=thinking)
    mask = np.zeros(len(ids), bool)
    for start, stop in spans:
        mask[start:stop] = True
    return {"input_ids": np.asarray(ids[:max_len], np.int32), "loss_mask": mask[:max_len]}
