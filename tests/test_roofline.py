"""The roofline profiles (infer/roofline.py, infer/projection.py) against numbers worked out by hand: Qwen3-8B's
verify cost on TPU v5p at batch 1 and 8, each chip's ridge K, the overhead calibration, and what a wider block buys
below and past the ridge. The hand arithmetic is written out as literal numbers, not through the code under test."""

import json
import math
import subprocess
import sys

import pytest

from dflash_model.config import preset
from dflash_model.drafter_config import drafter_config_for
from infer import roofline
from infer.projection import PROFILE_DIR, load_profile, load_profiles, project, prompt_costs

# Qwen3-8B: hidden 4096, MLP 12288, 36 layers, 32 query heads, 8 kv heads, head_dim 128, vocab 151936, untied.
#   one layer's matmuls: 4096 x 128 x (2 x 32 + 2 x 8) = 41,943,040 (q, k, v, o) + 3 x 4096 x 12288 = 150,994,944
#     (gate, up, down) = 192,937,984; x 36 layers = 6,945,767,424
#   lm_head: 151936 x 4096 = 622,329,856; matmul weights per position: 6,945,767,424 + 622,329,856 = 7,568,097,280
#   norms: 36 x (2 x 4096 + 2 x 128) + 4096 = 308,224; weights read: 7,568,097,280 + 308,224 = 7,568,405,504 (the
#     untied input embedding is gathered, B x T rows, not read whole), 15,136,811,008 bytes in bf16
#   KV cache per context token: 36 x 2 x 8 x 128 x 2 bytes = 147,456; at context 1024: 150,994,944 bytes
#   attention FLOPs per (query, key) pair: 4 x 36 x 32 x 128 = 589,824
MATMUL = 7_568_097_280
WEIGHT_BYTES = 15_136_811_008
KV_1024 = 150_994_944
ATTENTION = 589_824
V5P_PEAK, V5P_BW = 459e12, 2765e9


def _v5p_verify_by_hand(k: int, batch: int) -> float:
    """time(K) / time(1), each max(FLOPs / peak, bytes / bandwidth), context 1024."""
    read = (WEIGHT_BYTES + batch * KV_1024) / V5P_BW

    def time(t):
        return max(batch * (2 * MATMUL * t + ATTENTION * t * (1024 + t)) / V5P_PEAK, read)

    return time(k) / time(1)


def test_qwen3_8b_forward_counts_match_the_configs_parameter_counts():
    cfg = preset("qwen3-8b")
    target, drafter = roofline.target_forward(cfg), roofline.drafter_forward(cfg)
    assert (target.body_params + target.head_params, 2 * target.weight_params) == (MATMUL, WEIGHT_BYTES)
    assert (target.attention_flops, 1024 * target.kv_bytes) == (ATTENTION, KV_1024)
    # The config's own counts (written independently): untied, so the input embedding is the one matrix not read.
    assert target.weight_params == cfg.num_params() - 151936 * 4096
    tied = preset("qwen3-4b")
    assert roofline.target_forward(tied).weight_params == tied.num_params()
    # The drafter reads its own weights (DrafterConfig.num_params) and the shared lm_head.
    d_cfg = drafter_config_for(cfg, mask_token_id=151669)
    assert drafter.weight_params == d_cfg.num_params() + 151936 * 4096


@pytest.mark.parametrize(
    "k, batch, expected",
    [
        # Batch 1: read = 15,136,811,008 + 150,994,944 = 15,287,805,952 bytes / 2765e9 = 5.529 ms. A one-token step
        # is 2 x 7,568,097,280 + 589,824 x 1025 = 15.74 GFLOP, 34 us at 459e12: bound by the read, 5.529 ms.
        # K=16: 2 x 7,568,097,280 x 16 + 589,824 x 16 x 1040 = 251,993,784,320 FLOPs, 0.549 ms < 5.529: 1.000
        (16, 1, 1.0),
        # K=256: 3,874,865,807,360 + 193,273,528,320 = 4,068,139,335,680 FLOPs, 8.863 ms / 5.529 = 1.603
        (256, 1, 1.603),
        # K=1024: 15,499,463,229,440 + 1,236,950,581,248 = 16,736,413,810,688 FLOPs, 36.46 ms / 5.529 = 6.595
        (1024, 1, 6.595),
        # Batch 8: read = 15,136,811,008 + 8 x 150,994,944 = 16,344,770,560 bytes, 5.911 ms; FLOPs 8x batch 1's.
        # K=16: 8 x 251,993,784,320 = 2,015,950,274,560 FLOPs, 4.392 ms < 5.911: 1.000
        (16, 8, 1.0),
        # K=256: 8 x 4,068,139,335,680 = 32,545,114,685,440 FLOPs, 70.90 ms / 5.911 = 11.995
        (256, 8, 11.995),
        # K=1024: 8 x 16,736,413,810,688 = 133,891,310,485,504 FLOPs, 291.7 ms / 5.911 = 49.346
        (1024, 8, 49.346),
    ],
)
def test_qwen3_8b_verify_cost_on_v5p(k, batch, expected):
    p = load_profile("tpu-v5p", shape="qwen3-8b", batch=batch, context=1024)
    assert p.verify_cost(k) == pytest.approx(_v5p_verify_by_hand(k, batch), rel=1e-12)
    assert p.verify_cost(k) == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize(
    "name, peak, bandwidth, ridge_k",
    [("tpu-v5p", 459e12, 2765e9, 168), ("tpu-v6e", 918e12, 1638e9, 559), ("h100", 989e12, 3.35e12, 297),
     ("h200", 989e12, 4.8e12, 208)],
)  # fmt: skip
def test_ridge_k_of_each_profile(name, peak, bandwidth, ridge_k):
    # Batch 1, Qwen3-8B, context 1024: verify(K) <= 1.05 while K's FLOPs take at most 1.05 x the read,
    #   589,824 K^2 + (2 x 7,568,097,280 + 589,824 x 1024) K <= 1.05 x 15,287,805,952 x peak / bandwidth,
    # whose positive root, floored, is the ridge K: v5p 168.2, v6e 559.6, h100 297.9, h200 208.8.
    a, b = ATTENTION, 2 * MATMUL + ATTENTION * 1024
    c = 1.05 * (WEIGHT_BYTES + KV_1024) * peak / bandwidth
    root = (-b + math.sqrt(b * b + 4 * a * c)) / (2 * a)
    p = load_profile(name)
    assert math.floor(root) == ridge_k == p.summary()["ridge_k"]
    assert p.verify_cost(ridge_k) <= 1.05 < p.verify_cost(ridge_k + 1)
    assert (p.summary()["peak_bf16_flops"], p.summary()["hbm_bytes_per_s"]) == (peak, bandwidth)


def test_the_calibration_point_costs_1_68_plain_steps():
    # Qwen3-4B (tied) + a 5-layer drafter on v5p, K=16, batch 1, context 1024:
    #   target read: 2 x 4,022,468,096 + 150,994,944 = 8,195,931,136 bytes; a 16-token verify is read-bound: 1.000
    #   drafter read: 2 x 926,383,360 (5 x 100,925,440 layers + 5 x 2560 x 2560 fc + 151936 x 2560 lm_head + norms)
    #     + 5 x 2 x 8 x 128 x 2 x 1024 = 20,971,520 bytes of its cache = 1,873,738,240; 1,873,738,240 / 8,195,931,136
    #     = 0.2286 plain steps
    #   overhead = 1.68 - 1.000 - 0.2286 = 0.4514
    draft = 1_873_738_240 / 8_195_931_136
    p = load_profile("tpu-v5p", shape="qwen3-4b")
    assert p.verify_cost(16) == 1.0 and p.draft_cost(16) - p.overhead == pytest.approx(draft, rel=1e-12)
    assert p.overhead == pytest.approx(1.68 - 1.0 - draft, rel=1e-12) == pytest.approx(0.4514, abs=1e-4)
    assert p.verify_cost(16) + p.draft_cost(16) == pytest.approx(1.68, rel=1e-12)
    # The published numbers the file holds give that round cost: TPOT_dflash x tau / 7.35 ms per dataset, median.
    cal = json.loads((PROFILE_DIR / "tpu-v5p.json").read_text())["calibration"]
    per_set = sorted(t * tau / cal["plain_tpot_ms"] for t, tau in cal["dflash_tpot_ms_and_tau"].values())
    assert per_set[2] == pytest.approx(1.676, abs=5e-4) and cal["round_cost"] == pytest.approx(per_set[2], abs=0.005)
    # The same overhead on every chip and target.
    assert {q.overhead for q in load_profiles(["tpu-v6e", "h100", "h200"], shape="smollm2-135m").values()} == {
        p.overhead
    }


ACCEPTED = [[4, 1, 6], [2, 2]]  # committed tokens per round of two prompts: 15 in 5 rounds


def _records(widths=None):
    return [{"accept_lengths": a, **({"verify_widths": widths[i]} if widths else {})} for i, a in enumerate(ACCEPTED)]


def test_a_wider_block_with_the_same_acceptance_pays_only_past_the_ridge():
    v5p = load_profiles(["tpu-v5p"])  # Qwen3-8B, batch 1: ridge K 168
    at = {k: project(v5p, _records(), k, has_drafter=True)["projected_speedup"]["tpu-v5p"] for k in (16, 128, 512)}
    p = v5p["tpu-v5p"]
    # Below the ridge a 128-wide round costs what a 16-wide one does, up to the drafter's own cost difference (0
    # here: its forward is read-bound at both widths).
    drafter_gap = abs(p.draft_cost(128) - p.draft_cost(16))
    assert abs(15 / at[128] - 15 / at[16]) <= 5 * drafter_gap + 1e-12 and at[128] == pytest.approx(at[16])
    # Past it the verify grows about linearly: the same acceptance projects lower.
    assert at[512] < at[16] - 0.5
    # At batch 8 the ridge is K=22: K=64 already costs more.
    b8 = load_profiles(["tpu-v5p"], batch=8)
    s16, s64 = (project(b8, _records(), k, has_drafter=True)["projected_speedup"]["tpu-v5p"] for k in (16, 64))
    assert s64 < s16


def test_a_round_without_a_drafter_forward_pays_verify_and_overhead():
    p = load_profile("tpu-v5p")
    out = project({"tpu-v5p": p}, _records(), 16, has_drafter=False)
    assert out["projected_round_cost"]["tpu-v5p"] == pytest.approx(1.0 + p.overhead)
    # A DFlash round of the same width pays the drafter's forward on top (0.220 plain steps for Qwen3-8B at K=16).
    with_drafter = project({"tpu-v5p": p}, _records(), 16, has_drafter=True)["projected_round_cost"]["tpu-v5p"]
    assert with_drafter - (1.0 + p.overhead) == pytest.approx(0.220, abs=1e-3)


def test_prompt_costs_sum_to_the_projection_and_refuse_per_prompt():
    profiles = load_profiles(["tpu-v5p", "this-machine"])
    for name, p in profiles.items():
        costs = prompt_costs(p, _records(), 16, has_drafter=True)
        assert len(costs) == 2 and 15 / sum(costs) == pytest.approx(
            project({name: p}, _records(), 16, True)["projected_speedup"][name]
        )
    # A width past the measured curve refuses that prompt only; the roofline prices it.
    widths = [[16, 16, 16], [16, 200]]
    cpu = prompt_costs(profiles["this-machine"], _records(widths), 16, has_drafter=True)
    assert cpu[0] == pytest.approx(3 * (1.944 + 0.17)) and math.isnan(cpu[1])
    assert all(math.isfinite(c) for c in prompt_costs(profiles["tpu-v5p"], _records(widths), 16, has_drafter=True))


def test_roofline_needs_no_jax():
    code = "import sys, infer.roofline, infer.metrics; assert 'jax' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_a_width_below_one_is_refused():
    with pytest.raises(ValueError, match="K=0"):
        load_profile("h100").verify_cost(0)
