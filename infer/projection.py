"""Accelerator profiles (infer/profiles/*.json) and the speedup they project for a decoder's measured rounds.

A profile prices one round in plain decode steps (one-token forwards of the same target): the verify of its width
K (`verify_cost`), plus `draft_cost` where a drafter forward ran, else `lookup_draft_cost` (n-gram, reply lookup,
lookup trees). A projection is committed tokens over the rounds' summed cost, not a timing: the measured
wall-clock speedup sits beside it. Each file says where its numbers come from (`source`, `derivation`). Two kinds:

  measured  (this-machine.json) a verify curve timed at some widths, interpolated linearly between them, a width
            outside them refused; one draft cost at every width. It holds for the target and machine it was timed
            on, whatever shape is asked for.
  roofline  (tpu-v5p, tpu-v6e, h100, h200) a chip's peak bf16 FLOP/s and HBM bandwidth; infer/roofline.py turns
            them into verify and drafter-forward costs at any K for a target shape (default Qwen3-8B with a
            5-layer DFlash drafter), batch and context. Every round also pays a fixed overhead (acceptance,
            bookkeeping, the host round trip) calibrated once on tpu-v5p's published round cost, so a round
            without a drafter forward pays verify + overhead, and one with it verify + drafter + overhead.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

from infer.metrics import projected_speedup, round_costs
from infer.roofline import RIDGE_TOLERANCE, Chip, RoundModel, calibrate_overhead

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
HEADLINE_PROFILE = "tpu-v5p"  # the profile a table shows in its own column (the others share one)
CALIBRATION_PROFILE = "tpu-v5p"  # the file whose `calibration` holds the published round cost the overhead comes from
DEFAULT_SHAPE = "qwen3-8b"  # the served target the project aims at
DEFAULT_DRAFTER_LAYERS = 5  # z-lab's DFlash b16 drafters
DEFAULT_DRAFTER_FEATURES = 5
DEFAULT_BATCH = 1
DEFAULT_CONTEXT = 1024  # tokens in the cache: a prompt plus a few hundred generated
SUMMARY_WIDTHS = (1, 16, 64, 128, 256, 1024)


@dataclasses.dataclass(frozen=True)
class Profile:
    """A measured profile: a verify curve at timed widths (interpolated; a width outside them refused)."""

    name: str
    verify_cost: dict[int, float]
    draft_cost: float
    lookup_draft_cost: float = 0.0
    source: str = ""

    @property
    def widths(self) -> tuple[int, int]:
        return min(self.verify_cost), max(self.verify_cost)

    def summary(self) -> dict:
        """The numbers a projection used (for eval.json; the derivation stays in the profile's file)."""
        return {
            "kind": "measured",
            "verify_cost": {str(k): v for k, v in sorted(self.verify_cost.items())},
            "draft_cost": self.draft_cost,
            "lookup_draft_cost": self.lookup_draft_cost,
            "file": f"infer/profiles/{self.name}.json",
        }


@dataclasses.dataclass(frozen=True)
class RooflineProfile:
    """A chip's roofline costs for one target shape, batch and context, plus the calibrated round overhead.

    verify_cost, draft_cost and lookup_draft_cost are functions of the width K (what metrics.round_costs takes):
    verify(K); the drafter's forward(K) + overhead; overhead."""

    name: str
    model: RoundModel
    overhead: float
    shape: str
    drafter_layers: int
    drafter_features: int
    spec: dict  # the file's spec block: each input's value and source
    source: str = ""

    def verify_cost(self, k: int) -> float:
        return self.model.verify(k)

    def draft_cost(self, k: int) -> float:
        return self.model.draft(k) + self.overhead

    def lookup_draft_cost(self, k: int) -> float:
        return self.overhead

    @functools.cached_property
    def ridge_k(self) -> int:
        return self.model.ridge_k()

    def summary(self) -> dict:
        """The inputs, the shape priced and what it gives (for eval.json; the derivation stays in the file)."""
        m = self.model
        return {
            "kind": "roofline",
            "peak_bf16_flops": m.chip.peak_flops,
            "hbm_bytes_per_s": m.chip.hbm_bytes_per_s,
            "spec_sources": {key: v["source"] for key, v in self.spec.items()},
            "ridge_flops_per_byte": round(m.chip.ridge, 1),
            "target": self.shape,
            "drafter": f"DFlash, {self.drafter_layers} layers at the target's shape, fc from "
            f"{self.drafter_features} target layers, the target's lm_head",
            "batch": m.batch,
            "context": m.context,
            "overhead": round(self.overhead, 4),
            "overhead_note": f"plain steps a round pays beyond its forwards, calibrated on {CALIBRATION_PROFILE} "
            "(infer/profiles/tpu-v5p.json, calibration) and assumed the same for every chip, target, batch and K",
            "ridge_k": self.ridge_k,
            "ridge_k_note": f"the largest K whose verify costs <= {RIDGE_TOLERANCE} plain steps",
            "verify_cost": {str(k): round(m.verify(k), 4) for k in SUMMARY_WIDTHS},
            "drafter_forward": {str(k): round(m.draft(k), 4) for k in SUMMARY_WIDTHS if k > 1},
            "draft_cost": "drafter_forward(K) + overhead",
            "lookup_draft_cost": "overhead",
            "file": f"infer/profiles/{self.name}.json",
        }


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def _read(name: str) -> dict:
    path = PROFILE_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"no accelerator profile {name!r}; the profiles are {available_profiles()}")
    return json.loads(path.read_text())


def _chip(name: str, raw: dict) -> tuple[Chip, dict]:
    path = PROFILE_DIR / f"{name}.json"
    try:
        spec = raw["spec"]
        chip = Chip(name, float(spec["peak_bf16_flops"]["value"]), float(spec["hbm_bytes_per_s"]["value"]))
        sources = [spec[k]["source"] for k in ("peak_bf16_flops", "hbm_bytes_per_s")]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path}: a roofline profile needs spec.peak_bf16_flops and spec.hbm_bytes_per_s, each a value and a "
            f"source ({e!r})"
        ) from e
    if not (chip.peak_flops > 0 and chip.hbm_bytes_per_s > 0 and all(sources) and raw.get("source")):
        raise ValueError(f"{path}: spec values must be positive, and each, like the file, name a source")
    return chip, spec


def _target_config(shape):
    """A TargetConfig from a preset name (dflash_model.config imports jax, so only when a roofline is built)."""
    if not isinstance(shape, str):
        return shape
    from dflash_model.config import preset

    return preset(shape)


@functools.lru_cache(maxsize=1)
def calibrated_overhead() -> float:
    """Plain steps a round pays beyond the roofline's verify and drafter forward: CALIBRATION_PROFILE's published
    round cost less what this model prices that round's forwards at (its chip, target, drafter, K, batch, context)."""
    raw = _read(CALIBRATION_PROFILE)
    chip, _ = _chip(CALIBRATION_PROFILE, raw)
    try:
        cal = raw["calibration"]
        model = RoundModel.of(
            chip,
            _target_config(cal["target"]),
            int(cal["drafter_layers"]),
            int(cal["drafter_features"]),
            int(cal["batch"]),
            int(cal["context"]),
        )
        return calibrate_overhead(model, int(cal["block_size"]), float(cal["round_cost"]))
    except (KeyError, TypeError) as e:
        raise ValueError(
            f"{PROFILE_DIR / CALIBRATION_PROFILE}.json: calibration needs target, drafter_layers, drafter_features, "
            f"batch, context, block_size and round_cost ({e!r})"
        ) from e


def load_profile(
    name: str,
    shape=DEFAULT_SHAPE,
    batch: int = DEFAULT_BATCH,
    context: int = DEFAULT_CONTEXT,
    drafter_layers: int = DEFAULT_DRAFTER_LAYERS,
    drafter_features: int = DEFAULT_DRAFTER_FEATURES,
) -> Profile | RooflineProfile:
    """The profile in infer/profiles/NAME.json; a roofline one priced for this target shape (a preset name or a
    TargetConfig), drafter, batch and context; a measured one as timed (the shape arguments do not apply)."""
    raw = _read(name)
    path = PROFILE_DIR / f"{name}.json"
    if raw.get("kind") == "roofline":
        chip, spec = _chip(name, raw)
        model = RoundModel.of(chip, _target_config(shape), drafter_layers, drafter_features, batch, context)
        label = shape if isinstance(shape, str) else "custom"
        return RooflineProfile(
            name, model, calibrated_overhead(), label, drafter_layers, drafter_features, spec, raw["source"]
        )
    try:
        verify = {int(k): float(v) for k, v in raw["verify_cost"].items()}
        profile = Profile(name, verify, float(raw["draft_cost"]), float(raw.get("lookup_draft_cost", 0.0)))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: expected verify_cost {{K: cost}} and draft_cost ({e!r})") from e
    if verify.get(1) != 1.0 or not raw.get("source"):
        raise ValueError(f"{path}: verify_cost must hold K=1 at 1.0 (a plain step) and the file a source")
    return dataclasses.replace(profile, source=raw["source"])


def load_profiles(
    names: list[str] | None = None,
    shape=DEFAULT_SHAPE,
    batch: int = DEFAULT_BATCH,
    context: int = DEFAULT_CONTEXT,
    drafter_layers: int = DEFAULT_DRAFTER_LAYERS,
    drafter_features: int = DEFAULT_DRAFTER_FEATURES,
) -> dict[str, Profile | RooflineProfile]:
    """{name: profile} of these names (default: every committed profile, the headline one first); the roofline ones
    priced for `shape` (a preset name such as "qwen3-8b" or "smollm2-135m", or a TargetConfig) at this batch and
    context with a DFlash drafter of `drafter_layers` layers."""
    if names is None:
        names = sorted(available_profiles(), key=lambda n: (n != HEADLINE_PROFILE, n))
    return {n: load_profile(n, shape, batch, context, drafter_layers, drafter_features) for n in names}


def _rounds(record: dict, block_size: int, has_drafter: bool) -> tuple[list[int], list[bool]]:
    """A record's verify width and drafter flag per round: its verify_widths (else the block size every round) and
    its drafted flags (else a drafter forward every round), no drafter forward at all for a lookup proposer."""
    n = len(record["accept_lengths"])
    widths = list(record.get("verify_widths") or [block_size] * n)
    drafted = [has_drafter and bool(d) for d in (record.get("drafted") or [True] * n)]
    return widths, drafted


def _costs(p) -> dict:
    return {"verify_cost": p.verify_cost, "draft_cost": p.draft_cost, "lookup_draft_cost": p.lookup_draft_cost}


def project(profiles: dict, records: list[dict], block_size: int, has_drafter: bool) -> dict:
    """{projected_speedup, projected_round_cost, projection_refused} of a decoder's per-prompt records under each
    profile. Each round costs its own verify width (records' verify_widths, else the block size) and a drafter
    forward where one ran (records' drafted, else every round of a decoder with a drafter). A width outside a
    measured profile's curve gives NaN for that profile and the refusal's reason."""
    lengths = [a for r in records for a in r["accept_lengths"]]
    widths, drafted = [], []
    for r in records:
        w, d = _rounds(r, block_size, has_drafter)
        widths += w
        drafted += d
    speedup, cost, refused = {}, {}, {}
    for name, p in profiles.items():
        try:
            s, c = projected_speedup(lengths, widths, drafted, **_costs(p), name=name)
        except ValueError as e:
            s, c, refused[name] = math.nan, math.nan, str(e)
        speedup[name], cost[name] = s, c
    return {"projected_speedup": speedup, "projected_round_cost": cost, "projection_refused": refused}


def prompt_costs(profile, records: list[dict], block_size: int, has_drafter: bool) -> list[float]:
    """Each prompt record's summed round cost in plain steps under `profile` (NaN for a record with a width the
    profile refuses), so that sum(committed tokens) / sum(costs) over any resample of prompts is the projected
    speedup of that resample."""
    out = []
    for r in records:
        widths, drafted = _rounds(r, block_size, has_drafter)
        try:
            out.append(float(sum(round_costs(widths, drafted, **_costs(profile), name=profile.name))))
        except ValueError:
            out.append(math.nan)
    return out
