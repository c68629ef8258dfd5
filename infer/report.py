"""What an evaluation writes and prints: its tables (one decoder, a comparison, several sets), the acceptance plots,
acceptance.csv (vllm-project/speculators' columns), and the identities of the weights it measured, for eval.json.
Reads only what infer/measure.py's `summarize` returns."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_model.files import atomic_write_text, sha256_file
from infer.intervals import comparisons, format_comparisons
from infer.measure import LOSSLESS_SAMPLED, TAU_NOTE
from infer.metrics import strict_dumps
from infer.projection import HEADLINE_PROFILE


def format_flips(flips: dict) -> str:
    return (
        f"plain decoding against fp32 plain decoding: {flips['identical']}/{flips['prompts']} answers identical; "
        f"first flips at tokens {[j for j in flips['first_flip'] if j is not None]}"
    )


def _num(x, digits: int = 3) -> str:
    """A number for a table; '-' where there is none (None or NaN: not measured, e.g. forwards not timed alone, or
    no round reached that position)."""
    return "-" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def _profiles_of(rep: dict) -> list[str]:
    """The report's projection profiles, the headline one first."""
    names = list(rep.get("projected_speedup") or {})
    return sorted(names, key=lambda n: n != HEADLINE_PROFILE)


def _times(x, digits: int = 2) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.{digits}f}x"


def _ci(pair, digits: int = 2) -> str:
    """' [lo, hi]' of a 95% interval, or '' where there is none (an older eval.json, or too few prompts)."""
    if not pair or any(v is None or math.isnan(v) for v in pair):
        return ""
    return f" [{pair[0]:.{digits}f}, {pair[1]:.{digits}f}]"


def _tau_cell(rep: dict) -> str:
    return _num(rep["tau"]) + _ci(rep.get("tau_ci"))


def _survival_cell(rep: dict, j: int) -> str:
    """S_j and its interval (j from 1)."""
    values = list(rep["acceptance_unconditional"])
    cis = list(rep.get("survival_ci") or [])
    if j > len(values):
        return "-"
    return _num(values[j - 1]) + _ci(cis[j - 1] if j <= len(cis) else None)


def _projected(rep: dict, profile: str) -> str:
    return _times((rep.get("projected_speedup") or {}).get(profile)) + _ci(
        (rep.get("projected_speedup_ci") or {}).get(profile)
    )


def _projected_others(rep: dict, names: list[str]) -> str:
    """'h100 1.91x, this-machine 0.70x': the non-headline profiles' projections in one cell."""
    return ", ".join(f"{n} {_projected(rep, n)}" for n in names) or "-"


def _tau_footer(rep: dict) -> str:
    return f"{rep.get('tau_note', TAU_NOTE)}."


def _projection_rows(rep: dict) -> list[str]:
    rows = []
    for name in _profiles_of(rep):
        cost = (rep.get("projected_round_cost") or {}).get(name)
        refused = (rep.get("projection_refused") or {}).get(name)
        detail = f"refused: {refused}" if refused else f"round = {_num(cost, 2)} plain steps"
        rows.append(f"| projected speedup, {name} profile (not a timing) | {_projected(rep, name)} ({detail}) |")
    return rows


def format_table(rep: dict) -> str:
    k = rep["block_size"]
    lines = [
        f"draft={rep['draft']}  K={k}  prompts={rep['prompts']}  max_new_tokens={rep['max_new_tokens']}  "
        f"{_decoding(rep)}",
        "| metric | value |",
        "|---|---|",
        f"| verify rounds | {rep['rounds']} |",
        f"| tau (committed tokens per round, bonus incl.; pooled over rounds, the headline) | {_tau_cell(rep)} |",
        f"| tau per prompt (mean over prompts of each prompt's tau) | {_num(rep.get('tau_per_prompt'))}"
        f"{_ci(rep.get('tau_per_prompt_ci'))} |",
        f"| tau, z-lab's count (per prompt; a last round's drafts past the budget counted) | "
        f"{_num(rep.get('tau_zlab'))} |",
        f"| TPOT plain (ms) | {_num(rep['tpot_plain_ms'], 2)} |",
        f"| TPOT speculative (ms) | {_num(rep['tpot_spec_ms'], 2)} |",
        f"| speedup, measured wall clock (decode only) | {_times(rep['speedup'], 3)}{_spread(rep)} |",
        *_projection_rows(rep),
        f"| loop overhead (round / its parts timed alone) | {_num(rep.get('loop_overhead'))} |",
        f"| tokens/s plain / speculative | {_num(rep['tokens_per_s_plain'], 2)} / "
        f"{_num(rep['tokens_per_s_spec'], 2)} |",
        f"| lossless mismatches (prompts) | {_lossless_cell(rep, 'mismatched')} |",
        "",
        "tau histogram: " + "  ".join(f"{t}:{c}" for t, c in rep["tau_histogram"].items()),
        "",
        "| draft position j | " + " | ".join(str(j) for j in range(1, k)) + " |",
        "|---|" + "---|" * (k - 1),
        "| survival S_j = P(>= j accepted) [95% interval] | "
        + " | ".join(_survival_cell(rep, j) for j in range(1, k))
        + " |",
        "| conditional P(j accepted given j-1) | " + " | ".join(_num(x) for x in rep["acceptance_conditional"]) + " |",
        "",
        _tau_footer(rep) + " Projected speedups are tau over the round cost an accelerator profile predicts "
        "(infer/profiles/NAME.json), not timings; the measured speedup is this run's wall clock.",
    ]
    for m in rep["mismatch_examples"]:
        lines.append(f"MISMATCH {m['id']}: first diff at {m['first_diff']}: plain {m['plain']} spec {m['spec']}")
    return "\n".join(lines)


def _nan_for_none(values) -> list[float]:
    """Rates read back from a strict eval.json hold None where the run had NaN; matplotlib wants NaN (a gap)."""
    return [math.nan if v is None else v for v in values]


def _plot_survival(reports: dict[str, dict], path: Path, title: str) -> None:
    """Two panels, one line per decoder up to its own K-1: survival S_j against position j, and the conditional
    acceptance at j beside it."""
    import matplotlib  # plots only: an eval that draws none never loads matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (surv_ax, cond_ax) = plt.subplots(1, 2, figsize=(11, 3.8), sharex=True)
    for name, r in reports.items():
        j = list(range(1, r["block_size"]))
        label = f"{name} (K={r['block_size']}, tau={_num(r['tau'], 2)})"
        ms = 3 if len(j) <= 16 else 0
        surv_ax.plot(j, _nan_for_none(r.get("survival", r["acceptance_unconditional"])), "o-", ms=ms, label=label)
        cond_ax.plot(j, _nan_for_none(r["acceptance_conditional"]), "s--", ms=ms, label=label)
    surv_ax.set_ylabel("survival $S_j$ = P(>= j drafts accepted)")
    cond_ax.set_ylabel("P(draft j accepted | drafts < j accepted)")
    for ax in (surv_ax, cond_ax):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("draft position j")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    surv_ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_survival_grid(grid: list[list[tuple[str, list[tuple[str, list]]]]], path: Path) -> None:
    """Panels of survival curves on a log scale, one row of panels per list in `grid`, each panel (title,
    [(label, [S_1, S_2, ...])]) with None for a slot without an estimate: several drafters' curves side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = max(len(row) for row in grid)
    fig, axes = plt.subplots(len(grid), cols, figsize=(5.5 * cols, 3.6 * len(grid)), squeeze=False)
    for row, ax_row in zip(grid, axes):
        for (title, curves), ax in zip(row, ax_row):
            last = 1  # the x axis ends past the deepest slot any curve reaches (a K=128 block rarely passes 20)
            for label, survival in curves:
                ax.plot(range(1, len(survival) + 1), _nan_for_none(survival), label=label, lw=1)
                last = max([last, *(j for j, v in enumerate(survival, 1) if v)])
            ax.set_xlim(0.5, last + 1.5)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("draft position j")
            ax.set_ylabel("P(>= j drafts accepted)")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_acceptance(rep: dict, path: Path) -> None:
    """One decoder's survival and conditional acceptance against draft position."""
    title = f"{rep['draft']}, K={rep['block_size']}, tau={_num(rep['tau'], 2)}, {rep['prompts']} prompts"
    _plot_survival({rep["draft"]: rep}, path, title)


def _spread(rep: dict) -> str:
    """'(min-max over R repeats)' of the speedup, or '' for one repeat."""
    per = rep.get("speedup_per_repeat") or []
    return f" ({min(per):.2f}-{max(per):.2f} over {len(per)})" if len(per) > 1 else ""


def _lossless_cell(rep: dict, count: str) -> str:
    """'0 / 10' mismatched or '10/10 equal' prompts; T > 0: 'in distribution (...)', no token check."""
    if rep.get("lossless_mismatches") is None:
        return rep.get("lossless", LOSSLESS_SAMPLED)
    if count == "equal":
        return f"{rep['prompts'] - rep['lossless_mismatches']}/{rep['prompts']} equal"
    return f"{rep['lossless_mismatches']} / {rep['prompts']}"


def _comparison_row(name: str, r: dict, headline: str, others: list[str]) -> str:
    return (
        f"| {name} | {r['block_size']} | {r.get('mean_verify_width', r['block_size']):.1f} | {_tau_cell(r)} | "
        f"{_num(r.get('tau_per_prompt'))} | {_num(r.get('tau_zlab'))} | "
        + " | ".join(_survival_cell(r, j) for j in (1, 2, 3))
        + f" | {_num(r['tpot_spec_ms'], 1)} | {_times(r['speedup'])}{_spread(r)} | {_projected(r, headline)} | "
        f"{_projected_others(r, others)} | {_num(r.get('loop_overhead'), 2)} | {_num(r['tokens_per_s_spec'], 2)} | "
        f"{_lossless_cell(r, 'equal')} |"
    )


def _decoding(rep: dict) -> str:
    """'greedy, batch 1' or 'temperature 0.7, batch 4 (tokens/s: the whole batch's)'."""
    t, b = rep.get("temperature", 0.0), rep.get("batch_size", 1)
    return (
        ("greedy" if not t else f"temperature {t}")
        + f", batch {b}"
        + (" (tokens/s: the whole batch's)" if b > 1 else "")
    )


def format_comparison(reports: dict[str, dict], found: list[dict] | None = None) -> str:
    """One row per decoder, plain first, then the paired comparisons (`found`, default `infer.intervals.comparisons`
    under the headline profile): the table a run prints at its end."""
    first = next(iter(reports.values()))
    names = _profiles_of(first)
    headline, others = (names[0], names[1:]) if names else ("-", [])
    lines = [
        f"{first['prompts']} prompts, up to {first['max_new_tokens']} new tokens, {_decoding(first)}; decoders "
        f"interleaved prompt by prompt, {first.get('repeats', 1)} repeat(s): TPOT and measured speedup are medians, "
        "decode only, the range over repeats in brackets; width = mean tokens verified per round; overhead = decode "
        "time / its verify and drafter forwards timed alone",
        f"| decoder | K | width | tau [95%] | tau/prompt | tau, z-lab | S_1 | S_2 | S_3 | TPOT ms | speedup, measured "
        f"| projected, {headline} | projected, other profiles | overhead | tokens/s | lossless |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
        f"| plain | 1 | 1.0 | 1.000 | 1.000 | 1.000 | - | - | - | {_num(first['tpot_plain_ms'], 1)} | 1.00x | 1.00x | "
        f"{', '.join(f'{n} 1.00x' for n in others) or '-'} | {_num(first.get('loop_overhead_plain'), 2)} | "
        f"{_num(first['tokens_per_s_plain'], 2)} | - |",
        *(_comparison_row(name, r, headline, others) for name, r in reports.items()),
        "",
        *(
            [format_comparisons(found if found is not None else comparisons(reports, headline)), ""]
            if len(reports) > 1
            else []
        ),
        _tau_footer(first) + " S_j = survival, P(at least j drafts accepted in a round). Projected = tau over "
        "the round cost a profile (infer/profiles/NAME.json) predicts for the rounds' verify widths, in plain decode "
        "steps: a projection, not a timing ('-': a width outside the profile's curve); the measured speedup is this "
        "run's wall clock.",
    ]
    return "\n".join(lines)


def plot_comparison(reports: dict[str, dict], path: Path, title: str = "") -> None:
    """Survival and conditional acceptance of several decoders against draft position (each up to its own K-1)."""
    _plot_survival(reports, path, title or "survival and conditional acceptance")


def params_sha256(params) -> str | None:
    """sha256 over a drafter's parameter arrays (dtype, shape, bytes, in tree order); None where it has none."""
    leaves = jax.tree.leaves(params)
    if not leaves:
        return None
    h = hashlib.sha256()
    for x in leaves:
        if jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        a = np.asarray(x)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def target_sha256(path: Path) -> str:
    """sha256 of the target's weight file, or over its directory's weight files' (name, sha256) in name order."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    files = sorted(f for pattern in ("*.safetensors", "*.gguf", "*.bin") for f in path.glob(pattern))
    return hashlib.sha256("".join(f"{f.name} {sha256_file(f)}\n" for f in files).encode()).hexdigest()


def acceptance_rows(results: dict[str, dict]) -> tuple[list[str], list[dict]]:
    """(columns, rows) of acceptance.csv: one row per set and decoder in vllm-project/speculators' columns (its
    evaluate script's acceptance.csv; `decoder` added): num_drafts = verify rounds, num_draft_tokens = drafts
    verified, num_accepted_tokens = drafts accepted, acceptance_length = 1 + accepted / rounds (tau_pooled),
    acceptance_at_pos_i = rounds that accepted draft i+1 / rounds (survival S_(i+1))."""
    rows, positions = [], 0
    for name, res in results.items():
        for decoder, r in res["reports"].items():
            lengths = [a for p in r["per_prompt"] for a in p["accept_lengths"]]
            widths = [w for p in r["per_prompt"] for w in p.get("verify_widths", [])]
            drafts = sum(w - 1 for w in widths) if len(widths) == len(lengths) else len(lengths) * (r["block_size"] - 1)
            row = {
                "subset": name,
                "decoder": decoder,
                "num_drafts": len(lengths),
                "num_draft_tokens": drafts,
                "num_accepted_tokens": sum(a - 1 for a in lengths),
                "acceptance_length": 1 + sum(a - 1 for a in lengths) / len(lengths) if lengths else 0,
            }
            survival = r["acceptance_unconditional"]
            row.update(
                {f"acceptance_at_pos_{i}": 0 if s is None or math.isnan(s) else s for i, s in enumerate(survival)}
            )
            positions = max(positions, len(survival))
            rows.append(row)
    columns = ["subset", "decoder", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_length"]
    return columns + [f"acceptance_at_pos_{i}" for i in range(positions)], rows


def write_acceptance_csv(results: dict[str, dict], path: Path) -> None:
    columns, rows = acceptance_rows(results)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def format_sets(results: dict[str, dict], skipped: dict[str, str]) -> str:
    """One row per set and decoder (the sets of one run, each against its own plain decoding), then the skipped
    sets."""
    first = next(iter(next(iter(results.values()))["reports"].values()))
    lines = [
        f"up to {first['max_new_tokens']} new tokens, {_decoding(first)}, {first.get('repeats', 1)} repeat(s); "
        "speedup: decode-only wall clock against plain decoding of the same set, interleaved",
        f"| set | prompts | decoder | K | tau [95%] | tau/prompt | tau, z-lab | S_1 | S_2 | S_3 | speedup, measured "
        f"| projected, {HEADLINE_PROFILE} | lossless |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, res in results.items():
        for decoder, r in res["reports"].items():
            lines.append(
                f"| {name} | {r['prompts']} | {decoder} | {r['block_size']} | {_tau_cell(r)} | "
                f"{_num(r.get('tau_per_prompt'))} | {_num(r.get('tau_zlab'))} | "
                + " | ".join(_survival_cell(r, j) for j in (1, 2, 3))
                + " | "
                f"{_times(r['speedup'])}{_spread(r)} | {_projected(r, HEADLINE_PROFILE)} | "
                f"{_lossless_cell(r, 'equal')} |"
            )
    lines += [f"| {name} | - | skipped: {why} | | | | | | | | | | |" for name, why in skipped.items()]
    lines += ["", _tau_footer(first) + " S_j = survival, P(at least j drafts accepted in a round)."]
    for name, res in results.items():
        if len(res["reports"]) > 1:
            lines += ["", f"{name}: " + format_comparisons(comparisons(res["reports"], HEADLINE_PROFILE))]
    return "\n".join(lines)


# --- sets kept as they finish ----------------------------------------------------------------------------------------
# A run of several sets keeps each set's result as soon as it is decoded (OUT/sets/NAME.json, beside what the run is:
# its `about`), so a run stopped in its third set, rerun with the same command, decodes only what is left. The kept
# files go once eval.json is written.
KEPT = "sets"


def set_file_name(name: str) -> str:
    """A set's name as a file name: a named set as it is, a JSONL path or hf:ORG/NAME with every character a file
    name cannot safely hold replaced by `_`."""
    return re.sub(r"[^\w.-]+", "_", name).strip("_") or "set"


def finished_set(out: Path, name: str, about: dict) -> dict | None:
    """A set's result kept by an earlier run of this same evaluation (equal `about`: command, weights, device,
    profiles), else None."""
    path = out / KEPT / f"{set_file_name(name)}.json"
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    same = isinstance(kept, dict) and kept.get("about") == json.loads(strict_dumps(about))
    return kept["result"] if same and isinstance(kept.get("result"), dict) else None


def keep_set(out: Path, name: str, about: dict, result: dict) -> None:
    (out / KEPT).mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / KEPT / f"{set_file_name(name)}.json", strict_dumps({"about": about, "result": result}))


def drop_kept_sets(out: Path) -> None:
    shutil.rmtree(out / KEPT, ignore_errors=True)
