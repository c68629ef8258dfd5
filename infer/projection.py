"""Accelerator profiles (infer/profiles/*.json) and the speedup they project for a decoder's measured rounds.

A profile gives, in plain decode steps (one-token verifies), the cost of a K-token verify at measured widths K
(`verify_cost`, interpolated linearly between them, a width outside them refused), the cost of a drafter's forward
plus the rest of a round (`draft_cost`), and what a round of a proposer without a drafter forward costs on top of
its verify (`lookup_draft_cost`). Each file says where its numbers come from (`source`, `derivation`). A projection
is tau over the round cost the profile predicts, not a timing: the measured wall-clock speedup sits beside it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from infer.metrics import projected_speedup

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
HEADLINE_PROFILE = "tpu-v5p"  # the profile a table shows in its own column (the others share one)


@dataclasses.dataclass(frozen=True)
class Profile:
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
            "verify_cost": {str(k): v for k, v in sorted(self.verify_cost.items())},
            "draft_cost": self.draft_cost,
            "lookup_draft_cost": self.lookup_draft_cost,
            "file": f"infer/profiles/{self.name}.json",
        }


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name: str) -> Profile:
    path = PROFILE_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"no accelerator profile {name!r}; the profiles are {available_profiles()}")
    raw = json.loads(path.read_text())
    try:
        verify = {int(k): float(v) for k, v in raw["verify_cost"].items()}
        profile = Profile(name, verify, float(raw["draft_cost"]), float(raw.get("lookup_draft_cost", 0.0)))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: expected verify_cost {{K: cost}} and draft_cost ({e!r})") from e
    if verify.get(1) != 1.0 or not raw.get("source"):
        raise ValueError(f"{path}: verify_cost must hold K=1 at 1.0 (a plain step) and the file a source")
    return dataclasses.replace(profile, source=raw["source"])


def load_profiles(names: list[str] | None = None) -> dict[str, Profile]:
    """{name: Profile} of these names (default: every committed profile, the headline one first)."""
    if names is None:
        names = sorted(available_profiles(), key=lambda n: (n != HEADLINE_PROFILE, n))
    return {n: load_profile(n) for n in names}


def project(profiles: dict[str, Profile], records: list[dict], block_size: int, has_drafter: bool) -> dict:
    """{projected_speedup, projected_round_cost, projection_refused} of a decoder's per-prompt records under each
    profile. Each round costs its own verify width (records' verify_widths, else the block size) and a drafter
    forward where one ran (records' drafted, else every round of a decoder with a drafter). A width outside a
    profile's curve gives None for that profile and the refusal's reason."""
    lengths = [a for r in records for a in r["accept_lengths"]]
    widths, drafted = [], []
    for r in records:
        n = len(r["accept_lengths"])
        widths += list(r.get("verify_widths") or [block_size] * n)
        drafted += [has_drafter and bool(d) for d in (r.get("drafted") or [True] * n)]
    speedup, cost, refused = {}, {}, {}
    for name, p in profiles.items():
        try:
            s, c = projected_speedup(
                lengths,
                widths,
                drafted,
                verify_cost=p.verify_cost,
                draft_cost=p.draft_cost,
                lookup_draft_cost=p.lookup_draft_cost,
                name=name,
            )
        except ValueError as e:
            s, c, refused[name] = math.nan, math.nan, str(e)
        speedup[name], cost[name] = s, c
    return {"projected_speedup": speedup, "projected_round_cost": cost, "projection_refused": refused}
