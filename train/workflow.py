"""What a full training run does around the Trainer: build its data with the target, say what it will do, and
evaluate the exported drafter at the end.

`train/run.py` calls, in order: `load_target_model`, `prepare_regenerated` (when data.source is `regenerate`) or
`prepare_mix` (when it is `mix`), `announce`, the Trainer, `final_eval`. Each step keeps its output on disk
(regenerated or mixed JSONL in the cache, checkpoints, export, eval JSON), so a second run of the same config skips
what is already done.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path

import jax
from flax import nnx
from jax.experimental import multihost_utils

from data.conversations import iter_jsonl, load_conversations
from data.mix import mix, parse_part
from dflash_model import sharding as shd
from dflash_model.drafter_weights import export_drafter
from dflash_model.files import atomic_write_bytes, atomic_write_text, cache_root, run_path
from dflash_model.target import is_maxtext
from dflash_model.tokenizer import load_tokenizer, stop_token_ids
from infer.agreement import compare, format_agreement, teacher_forced
from infer.eval_sets import dataset_messages, encode
from infer.intervals import comparisons, format_comparisons
from infer.loading import dflash_draft, load_draft_spec
from infer.measure import run_comparison
from infer.metrics import strict_dumps
from infer.projection import HEADLINE_PROFILE
from infer.report import format_comparison, format_table, plot_comparison
from train.assembly import EXPORT_LAYOUT, export_verifier
from train.regenerate import first_turn_prompt, pending, regenerate

log = logging.getLogger("dflash.train")


# ----------------------------------------------------------------------------------------------------------
# Data: the target's own replies to the first turns of a conversation set, with a held-out tail for eval.


def regenerated_path(rcfg, target_name: str) -> Path:
    """Where the regenerated training JSONL lives: data.regenerate.output, or a cache file named by every
    setting that changes its contents (so changing one regenerates, and the same config reuses it)."""
    if rcfg.output is not None:
        return Path(rcfg.output)
    stem = Path(str(rcfg.prompts)).stem
    # `hc`: the held-out count is of whole conversations (a file named `-h` held out records, another training set)
    name = f"{target_name}-{stem}-n{rcfg.limit}-hc{rcfg.heldout}-p{rcfg.max_prompt_tokens}-t{rcfg.max_new_tokens}.jsonl"
    return cache_root() / "regenerated" / name


def conversation_of(record_id: str) -> str:
    """The conversation a record belongs to: ShareGPT splits a long conversation into records `<id>_<part>`
    (`CipTWlm_0`, `CipTWlm_4`, ...), whose later parts continue the earlier ones' topic and text."""
    stem, sep, part = str(record_id).rpartition("_")
    return stem if sep and part.isdigit() else str(record_id)


def split_heldout(conversations: list[dict], heldout: int) -> tuple[list[dict], list[dict]]:
    """(train records, held-out records): the last `heldout` whole conversations (every record of each, by
    `conversation_of`) never reach training, so no eval prompt is a turn of a conversation trained on."""
    order = list(dict.fromkeys(conversation_of(c["id"]) for c in conversations))
    if heldout < 0 or heldout >= len(order):
        raise ValueError(
            f"data.regenerate.heldout={heldout} must be in 0..{len(order) - 1} "
            f"({len(order)} conversations in the {len(conversations)} records read)"
        )
    held_out = set(order[len(order) - heldout :])
    train = [c for c in conversations if conversation_of(c["id"]) not in held_out]
    return train, [c for c in conversations if conversation_of(c["id"]) in held_out]


def heldout_prompts(held: list[dict]) -> list[dict]:
    """One eval prompt per held-out conversation: the first turn of its first record (later records of a
    ShareGPT conversation continue it, and would weigh a long conversation many times)."""
    rows, seen = [], set()
    for c in held:
        conv = conversation_of(c["id"])
        prompt = first_turn_prompt(c["messages"])
        if conv not in seen and prompt is not None:
            seen.add(conv)
            rows.append({"id": c["id"], "messages": prompt})
    return rows


def prepare_regenerated(cfg, model, tok, target_name: str) -> tuple[Path, list[dict]]:
    """Say the run's plan (`announce_start`, with the replies still to regenerate), then regenerate (resuming) the
    training replies; returns (training JSONL, held-out prompt rows for eval)."""
    r = cfg.data.regenerate
    convs, _ = load_conversations(r.prompts, limit=int(r.limit), require_assistant=False)
    train_convs, held = split_heldout(convs, int(r.heldout))
    out = regenerated_path(r, target_name)
    out.parent.mkdir(parents=True, exist_ok=True)
    announce_start(cfg, regen_todo=pending(train_convs, tok, out, int(r.max_prompt_tokens)))
    t0 = time.perf_counter()
    stats = regenerate(
        model,
        tok,
        train_convs,
        out,
        batch_size=int(r.batch_size),
        max_new_tokens=int(r.max_new_tokens),
        max_prompt_tokens=int(r.max_prompt_tokens),
        target_name=target_name,
    )
    if stats["written"]:
        log.info(
            "regenerated %d replies (%d tokens) in %.1f min -> %s; %d were already there, skipped %s",
            stats["written"],
            stats["new_tokens"],
            (time.perf_counter() - t0) / 60,
            out,
            stats["already_done"],
            stats["skipped"] or "none",
        )
    else:
        log.info("regenerated data already complete: %s (%d replies)", out, stats["already_done"])
    return out, heldout_prompts(held)


def prepare_mix(dcfg) -> Path:
    """data.source=mix: data.mix's parts of reply files (data/mix.py) shuffled with data.mix_seed into one JSONL in
    the cache, named by the digest of its contents (the same parts and seed reuse it; any change writes another)."""
    rows = mix([parse_part(str(p)) for p in dcfg.mix], int(dcfg.mix_seed))
    body = "".join(rows).encode("utf-8")
    out = cache_root() / "mixed" / f"mix-{hashlib.sha256(body).hexdigest()[:16]}.jsonl"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out, body)
    log.info("data.mix: %d rows from %d parts -> %s", len(rows), len(dcfg.mix), out)
    return out


# ----------------------------------------------------------------------------------------------------------
# The plan, said up front.

# Rough rates on a 2-core x86 CPU, fp32 SmolLM2-135M (measured, see README): enough for an order of magnitude.
REGEN_TOKENS_PER_S = 80.0
EVAL_S_PER_PROMPT_TOKEN = 0.35  # three decoders (plain, n-gram, DFlash) per new token, plus their compiles


def announce_start(cfg, *, regen_todo: int = 0) -> None:
    """Log what the run will do and roughly how long the parts before and after training take (training's own
    ETA is logged with every step line)."""
    parts = []
    if regen_todo:
        r = cfg.data.regenerate
        mins = regen_todo * int(r.max_new_tokens) * 0.8 / REGEN_TOKENS_PER_S / 60
        parts.append(f"regenerate {regen_todo} replies with the target (~{mins:.0f} min, once: cached for later runs)")
    t = cfg.train
    length = f"{t.steps} steps" if t.steps is not None else f"{t.epochs} epoch{'' if t.epochs == 1 else 's'}"
    per_step = f"{t.batch_size} sequence{'' if t.batch_size == 1 else 's'} a step"
    parts.append(
        f"train a K={cfg.block_size} drafter for {length} ({per_step}), "
        f"checkpointing to {cfg.checkpoint.dir or run_path(cfg.run_dir, 'checkpoints')}"
    )
    if cfg.export.enabled:
        parts.append(f"export it in the z-lab format to {run_path(cfg.run_dir, 'export')}")
    if cfg.eval.enabled:
        e = cfg.eval
        mins = int(e.num_prompts) * int(e.max_new_tokens) * EVAL_S_PER_PROMPT_TOKEN / 60
        parts.append(
            f"evaluate it vs n-gram vs plain decoding on {e.num_prompts} {e.prompts} prompts (~{mins:.0f} min)"
        )
    log.info("plan: %s", "; ".join(f"({i}) {p}" for i, p in enumerate(parts, 1)))


# ----------------------------------------------------------------------------------------------------------
# The end-of-run evaluation: the exported drafter through the shared decode loop (infer/), vs plain and n-gram.


def eval_rows(cfg, heldout: list[dict] | None) -> list[dict]:
    e = cfg.eval
    if e.prompts == "heldout":
        if heldout is None:
            raise ValueError("eval.prompts=heldout needs data.source=regenerate (it holds prompts out of training)")
        rows = heldout
    elif e.prompts == "sharegpt":
        convs, _ = load_conversations("sharegpt", limit=e.records, require_assistant=False)
        rows = heldout_prompts(convs)
    else:
        rows = dataset_messages(str(e.prompts))
    return untrained(rows, cfg.data.source)  # final_eval then drops long prompts and keeps eval.num_prompts


def untrained(rows: list[dict], source) -> list[dict]:
    """`rows` less those of a conversation (by record id, `conversation_of`) that the training JSONL `source` holds:
    an eval prompt must not be a turn of a conversation trained on. Sources that are not a JSONL file (synthetic
    data, a packaged set) pass through."""
    path = Path(str(source)).expanduser()
    if path.suffix not in (".jsonl", ".gz") or not path.is_file():
        return rows
    trained = {conversation_of(r["id"]) for _, r in iter_jsonl(path) if isinstance(r, dict) and "id" in r}
    keep = [r for r in rows if conversation_of(r["id"]) not in trained]
    if len(keep) < len(rows):
        dropped = len(rows) - len(keep)
        log.info("eval: %d of %d prompts are of conversations trained on (%s): dropped", dropped, len(rows), path.name)
    return keep


def end_of_run_eval(cfg, trainer, summary: dict, tokenizer, heldout: list[dict] | None) -> dict | None:
    """After a finished run with eval.enabled: the reports of `final_eval`, or None when there is nothing to do
    (not enabled, stopped early, an eval of this very step already on disk) or on processes other than 0.

    Every process must call this. Under several processes, process 0 decodes alone with a copy of the target
    gathered onto its own devices (the decode loop reads values on the host every round, which an array that
    spans other processes' devices does not allow), and the others wait for it at a barrier."""
    finished = trainer.step >= trainer.total_steps and summary["stopped_by"] is None
    if not cfg.eval.enabled or not finished:
        return None
    if is_maxtext(trainer.run.target):
        log.warning("the end-of-run eval decodes with the Tunix target, not MaxText's: run python -m infer.eval "
                    "--target %s --draft <run_dir>/export", cfg.target.path)  # fmt: skip
        return None
    export = Path(summary["export"]) if summary.get("export") else None
    many = jax.process_count() > 1
    if many and not cfg.export.enabled:  # on every process: only process 0's summary names the export
        log.warning(
            "eval.enabled under several processes evaluates the exported drafter, and export.enabled is "
            "false: no eval (export it, then run python -m infer.eval)"
        )
        return None
    prior = trainer.run_dir / "eval" / "eval.json"
    # Process 0's file system decides, so every process takes the same path through the collectives.
    if shd.process0_decides(_same_eval(prior, cfg, trainer.step)):
        if jax.process_index() == 0:
            log.info(
                "eval of step %d already in %s:\n%s",
                trainer.step,
                prior.parent,
                Path(prior.parent, "table.md").read_text(),
            )
        return None
    target = _process0_target(trainer) if many else trainer.run.target
    reports = None
    if jax.process_index() == 0:
        if tokenizer is None and (cfg.data.tokenizer or trainer.run.tokenizer_path):
            tokenizer = load_tokenizer(cfg.data.tokenizer or trainer.run.tokenizer_path)
        reports = final_eval(cfg, trainer, tokenizer, eval_rows(cfg, heldout), export, target=target)["reports"]
    shd.barrier("dflash end-of-run eval")
    return reports


def eval_settings(cfg) -> dict:
    """Everything an end-of-run eval's numbers depend on besides the drafter's step (a cached eval is reused only
    when these match)."""
    return {
        **cfg.to_dict()["eval"],
        "block_size": cfg.block_size,
        "features_zero": cfg.features.zero,
    }


def _same_eval(prior: Path, cfg, step: int) -> bool:
    if not prior.is_file():
        return False
    try:
        old = json.loads(prior.read_text())
    except json.JSONDecodeError:
        return False  # written atomically since, but an old torn file is simply redone
    return old.get("trained_steps") == step and old.get("settings") == eval_settings(cfg)


def _process0_target(trainer):
    """The trainer's target gathered whole (a collective: every process calls it) and, on process 0, placed on
    that process's own devices, FSDP-sharded over them; None elsewhere."""
    whole = multihost_utils.process_allgather(trainer.run.t_state, tiled=True)  # tiled: the global value itself
    if jax.process_index() != 0:
        return None
    local = shd.make_mesh(fsdp=jax.local_device_count(), devices=jax.local_devices())
    return shd.shard_model(nnx.merge(trainer.run.t_graph, whole), local)


def train_serve(target, trainer, dflash, prompts: list[list[int]], report: dict) -> dict:
    """The acceptance the training pass estimates beside what real decoding got (`infer.agreement.compare`): on
    the eval's prompts and the target's plain greedy replies to them (the report's plain_tokens), blocks at every
    reply position, at the decoded K. The drafter is the trained one as the loss saw it (in memory), so a wrong
    export shows as a gap too; under several processes its parameters span other processes' devices, and the
    exported one stands in."""
    one = jax.process_count() == 1
    drafter = trainer.drafter() if one else dflash.params
    replies = [r["plain_tokens"] for r in report["per_prompt"]]
    proposer = dflash.proposer
    estimate = teacher_forced(
        target,
        drafter,
        dflash.block_size,
        prompts,
        replies,
        zero_features=proposer.zero_features,
        vocab=proposer.vocab,
    )
    return {**compare(estimate, report), "teacher_forced_drafter": "trained, in memory" if one else "exported"}


def final_eval(cfg, trainer, tokenizer, rows: list[dict], export_dir: Path | None, target=None) -> dict:
    """Decode `rows` plainly, with the trained drafter and with n-gram; write <run_dir>/eval/ and print a table.
    `target` defaults to the trainer's."""
    e = cfg.eval
    target = trainer.run.target if target is None else target
    target_cfg = trainer.run.target_cfg
    block = int(e.block) if e.block is not None else None
    zero = cfg.features.zero
    if export_dir is not None:
        # The exported files, as a server would load them (bf16 values, computed in the target's dtype).
        dflash = load_draft_spec(str(export_dir), target_cfg, block, dtype=target_cfg.dtype, zero_features=zero)
    else:
        drafter = trainer.drafter()
        vocab = None if trainer.run.vocab_ids is None else tuple(int(i) for i in jax.device_get(trainer.run.vocab_ids))
        dflash = dflash_draft("dflash", drafter, drafter.config, block, zero_features=zero, vocab=vocab)
    drafts = [dflash]
    for k in e.also_blocks:  # each in 2..the eval's K: train.config checked it when the config was read
        # The same drafter at a narrower width: what a server running a wide drafter at K=16 gets.
        drafts.append(dataclasses.replace(dflash, name=f"dflash@{int(k)}", block_size=int(k)))
    if export_dir is not None and e.fullvocab and dflash.proposer.vocab is not None:
        # The same files over the whole vocabulary: what a z-lab server runs (the format has no draft vocabulary).
        spec = f"fullvocab:{export_dir}"
        served = load_draft_spec(spec, target_cfg, block, dtype=target_cfg.dtype, zero_features=zero)
        drafts.append(dataclasses.replace(served, name="dflash-fullvocab"))
    if e.shipped is not None:
        shipped = Path(e.shipped)
        if (shipped / "config.json").is_file():
            # A committed drafter trained by the long recipe, served from its files as a server would load them.
            drafts.append(
                dataclasses.replace(load_draft_spec(str(shipped), target_cfg, dtype=target_cfg.dtype), name="shipped")
            )
        else:
            log.info("eval: no shipped drafter at eval.shipped=%s; its row is left out", shipped)
    drafts.append(load_draft_spec("ngram", target_cfg, int(e.ngram_block)))
    if dflash.block_size != int(e.ngram_block):
        # The yardstick for the drafter: n-gram at the drafter's own K (a baseline at another K prices other rounds).
        same_k = load_draft_spec("ngram", target_cfg, dflash.block_size)
        drafts.append(dataclasses.replace(same_k, name=f"ngram@{dflash.block_size}"))
    prompts = encode(rows, tokenizer)
    keep = [i for i, p in enumerate(prompts) if len(p) <= int(e.max_prompt_tokens)]
    if len(keep) < len(prompts):
        log.info(
            "eval: %d of %d prompts are longer than eval.max_prompt_tokens=%s; skipped",
            len(prompts) - len(keep),
            len(prompts),
            e.max_prompt_tokens,
        )
    keep = keep[: int(e.num_prompts)]
    prompts, ids = [prompts[i] for i in keep], [rows[i]["id"] for i in keep]
    if not prompts:
        raise ValueError("no eval prompt left; raise eval.max_prompt_tokens or eval.num_prompts")
    t0 = time.perf_counter()
    reports = run_comparison(
        target,
        drafts,
        prompts,
        max_new_tokens=int(e.max_new_tokens),
        stop_ids=tuple(stop_token_ids(tokenizer)) if tokenizer is not None else (),
        ids=ids,
    )
    out = trainer.run_dir / "eval"
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "prompts": str(e.prompts),
        "num_prompts": len(prompts),
        "wall_s": time.perf_counter() - t0,
        "trained_steps": trainer.step,
        "settings": eval_settings(cfg),
        "drafter": str(export_dir or "in-memory"),
        "reports": reports,
    }
    plot_comparison(
        reports,
        out / "acceptance.png",
        title=f"held-out acceptance after {trainer.step} steps" if e.prompts == "heldout" else "",
    )
    # Equal K against equal K on tau; the trained drafter against the shipped one (another K) also on the projected
    # speedup; the trained drafter served at K=16 against the shipped K=16 one. Each with a paired interval.
    found = comparisons(reports, HEADLINE_PROFILE, pairs=[(f"dflash@{k}", "shipped") for k in e.also_blocks])
    summary["comparisons"] = found
    verdict = f"after {trainer.step} steps, on {len(prompts)} held-out prompts, " + format_comparisons(found)
    summary["verdict"] = verdict
    summary["train_serve"] = train_serve(target, trainer, dflash, prompts, reports["dflash"])
    table = (
        f"after {trainer.step} steps, on {len(prompts)} held-out prompts\n"
        + format_comparison(reports, found)
        + "\n\n"
        + format_agreement(summary["train_serve"])
    )
    atomic_write_text(out / "table.md", table + "\n\n" + format_table(reports["dflash"]) + "\n")
    atomic_write_text(out / "eval.json", strict_dumps(summary, indent=1))
    print(table, flush=True)
    trainer.push()
    log.info("eval written to %s (eval.json, table.md, acceptance.png) in %.1f min", out, summary["wall_s"] / 60)
    return summary


def export_run(trainer) -> Path | None:
    """The trainer's drafter in export.format's format(s) (EXPORT_LAYOUT: <run_dir>/export/, and
    export-speculators/ for `both`). With several processes every one must call this (the parameters are gathered
    across them); process 0 writes and gets the path of export/, the others None."""
    if jax.process_count() > 1:
        params = multihost_utils.process_allgather(trainer.state["params"], tiled=True)  # host numpy, whole
        if jax.process_index() != 0:
            return None
        drafter = nnx.merge(trainer.d_graph, params)
    else:
        drafter = trainer.drafter()
    cfg = trainer.cfg
    verifier = export_verifier(cfg, trainer.run.target_cfg)
    paths = [
        export_drafter(
            drafter,
            drafter.config,
            trainer.run_dir / sub,
            dtype=cfg.export.dtype,
            draft_vocab=trainer.run.vocab_ids,
            fmt=fmt,
            verifier=verifier,
        )
        for fmt, sub in EXPORT_LAYOUT[cfg.export.format]
    ]
    trainer.push()
    return paths[0]
