"""The target's own greedy replies to rows of prompt sets, for the teacher-forced measure (infer.teacher_forced):
plain greedy decoding (`infer.plain.greedy_replies`, batched by length bucket), a later turn asked after the
target's answers to the earlier ones; or an earlier run's replies, reused where its settings match (one decode
serves any number of drafters).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm

from infer.eval_sets import conversation, earlier_conversations, encode
from infer.loading import check_prompt_ids, fit_prompts
from infer.plain import greedy_replies


def _chat(row: dict, answers: dict[str, str]) -> dict:
    """A row as infer.eval's `encode` takes it, a later turn written after the earlier turns' answers."""
    if "earlier_turns" in row:
        return {"id": row["id"], "messages": conversation([*row["earlier_turns"], row["text"]], answers)}
    if "text" in row:
        return {"id": row["id"], "messages": [{"role": "user", "content": row["text"]}]}
    return row


class Replier:
    """Turns rows into (prompt ids, reply) with the target: a later turn is asked after the target's own greedy
    answers to the earlier ones (infer.eval's `answer_earlier_turns`, here from the batched plain path, and an
    earlier turn that is itself a row answered once)."""

    def __init__(self, args, target, k: int, stop_ids, progress: bool, known: dict | None = None):
        self.args, self.target, self.k, self.stop_ids, self.progress = args, target, k, stop_ids, progress
        self.answers: dict[str, str] = {}
        self.known = known or {}  # {prompt name: (prompt tokens, reply)} of an earlier run (--replies)
        self.used: set[str] = set()  # the prompt names this run asked for

    def _greedy(self, prompts: list[list[int]], names: list[str], desc: str) -> list[list[int]]:
        """Replies of an earlier run where it has them (the same prompt, checked by its length), the rest decoded."""
        for p, name in zip(prompts, names):
            if name in self.known and self.known[name][0] != len(p):
                raise ValueError(
                    f"--replies: {name} has {len(p)} prompt tokens here and {self.known[name][0]} there (another "
                    "tokenizer, template or --truncate-prompts)"
                )
        self.used.update(names)
        todo = [i for i, name in enumerate(names) if name not in self.known]
        decoded = []
        if todo:
            with tqdm(total=len(todo), desc=desc, disable=not self.progress, file=sys.stderr) as bar:
                decoded = greedy_replies(
                    self.target.model,
                    [prompts[i] for i in todo],
                    max_new_tokens=self.args.max_new_tokens,
                    stop_ids=self.stop_ids,
                    batch_size=self.args.batch_size,
                    bar=bar,
                )
        replies = [self.known[name][1] if name in self.known else None for name in names]
        for i, reply in zip(todo, decoded):
            replies[i] = reply
        return replies

    def _decode(self, chats: list[dict], names: list[str], desc: str) -> tuple[list, list, dict]:
        """(prompt ids, replies, prompts cut) of these chats; each answer kept for the turns after it."""
        prompts = encode(chats, self.target.tokenizer, thinking=self.args.thinking == "on")
        check_prompt_ids(prompts, self.target.config, names=names)
        prompts, cut = fit_prompts(
            prompts,
            self.target.config,
            max_new_tokens=self.args.max_new_tokens,
            width=self.k,
            names=names,
            truncate=self.args.truncate_prompts,
        )
        replies = self._greedy(prompts, names, desc)
        for chat, reply in zip(chats, replies):
            if "messages" in chat and self.target.tokenizer is not None:
                text = self.target.tokenizer.decode(reply, skip_special_tokens=True)
                self.answers[json.dumps(chat["messages"])] = text
        return prompts, replies, cut

    def replies(self, sets: dict[str, list[dict]]) -> dict[str, tuple[list, list, dict]]:
        """{set: (prompts, replies, prompts cut)}, every set's rows of one turn depth decoded together."""
        flat = [(name, i, r) for name, rows in sets.items() for i, r in enumerate(rows)]
        depth = max(len(r.get("earlier_turns", [])) for _, _, r in flat)
        got: dict[tuple[str, int], tuple] = {}
        cut: dict[str, dict] = {name: {} for name in sets}
        for level in range(depth + 1):
            here = [(name, i, r) for name, i, r in flat if len(r.get("earlier_turns", [])) == level]
            chats = [_chat(r, self.answers) for _, _, r in here]
            known = {json.dumps(c["messages"]) for c in chats if "messages" in c}
            needed = earlier_conversations([r for _, _, r in flat], level, self.answers)
            # the conversations deeper rows need that no row of this level is (nor an earlier level answered)
            extra = [c for key, c in needed.items() if key not in known and key not in self.answers]
            names = [f"--dataset {name}: prompt {r['id']}" for name, _, r in here] + [e["id"] for e in extra]
            prompts, replies, cut_here = self._decode(chats + extra, names, f"replies, turn {level + 1}")
            for (name, i, _), p, reply, what in zip(here, prompts, replies, names):
                got[name, i] = (p, reply)
                if what in cut_here:
                    cut[name][what] = cut_here[what]
        return {
            name: (
                [got[name, i][0] for i in range(len(rows))],
                [got[name, i][1] for i in range(len(rows))],
                cut[name],
            )
            for name, rows in sets.items()
        }


# The settings an earlier run's replies must share with this run to stand in for its own decoding.
REPLY_SETTINGS = ("target", "dtype", "max_new_tokens", "prompt_style", "thinking")


def earlier_replies(path: str, about: dict) -> dict[str, tuple[int, list[int]]]:
    """{prompt name: (prompt tokens, reply)} of an earlier run's teacher_forced.json (or its directory), refused
    where its target, dtype, budget, wording or thinking switch differ from this run's (`about`)."""
    file = Path(path) / "teacher_forced.json" if Path(path).is_dir() else Path(path)
    try:
        old = json.loads(file.read_text())
        sets = old["sets"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--replies {path!r}: not a teacher_forced.json of this command ({e})") from None
    differ = [
        f"{key} {old.get(key)!r} there, {about[key]!r} here" for key in REPLY_SETTINGS if old.get(key) != about[key]
    ]
    if differ:
        raise ValueError(f"--replies {path!r}: other replies than this run would decode: " + "; ".join(differ))
    return {
        f"--dataset {name}: prompt {p['id']}": (p["prompt_tokens"], p["reply"])
        for name, res in sets.items()
        for p in res["per_prompt"]
    }
