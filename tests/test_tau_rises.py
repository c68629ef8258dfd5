"""Training raises tau: on the tiny random target, a drafter trained for a few hundred steps on the target's own
greedy text has a simulated tau (the training metric) and a real tau (the speculative engine through
infer/eval.py's loader and decode loop, on held-out prompts) well above the untrained drafter's, and speculative
output stays equal to plain greedy output. The run: tests/tiny_runs.py, run_tiny_tau.
"""

import pytest
import tiny_runs as tt


@pytest.mark.long
@pytest.mark.slow
def test_training_raises_simulated_and_real_tau(tmp_path):
    # 250 steps at a constant 6e-3 (a cosine spends half of a short run at a low rate), 1024 training sequences
    # (<2 epochs), 8 held-out prompts, K=8, no n-gram reference (one compile fewer). 45-70 s on 2 busy CPU cores.
    s = tt.Settings(
        steps=250, block_size=8, train_prompts=1024, eval_prompts=8, lr=6e-3, schedule="constant", ngram=False
    )
    rep = tt.run_tiny_tau(s, tmp_path / "run")
    sim, real = rep["sim_tau"], rep["real_tau"]
    print(tt.format_tiny_tau(rep))
    assert rep["steps"] == 250

    # Measured (seed 0 / seeds 1, 2, 3 of the same settings; the seed draws the target, the drafter and the data):
    #   untrained: sim_tau step 1 1.000 / 1.000, 1.000, 1.094; held-out sim 1.000 (all); real tau 1.000 (all)
    #   trained:   sim_tau last 10 steps 3.75 / 4.17, 4.05, 3.12; held-out sim 3.17 / 4.99, 2.69, 4.13;
    #              real tau 3.20 / 5.81, 2.68, 4.12; real acceptance of draft 1: 0.40 / 0.84, 0.29, 0.54;
    #              loss 6.76 -> 1.72 / 6.65 -> 1.65, 6.70 -> 1.60, 6.31 -> 2.30
    # The bounds sit well below the worst seed, and a drafter that learned nothing (or learned text other than
    # the target's own greedy output) stays at tau ~1 and fails every one of them.
    assert sim["first_step"] < 1.5 and sim["heldout_untrained"] < 1.5, sim
    assert real["untrained"]["tau"] < 1.5, real["untrained"]
    assert sim["last10_mean"] > sim["first_step"] + 1.0, sim
    assert sim["heldout_trained"] > sim["heldout_untrained"] + 1.0, sim
    assert sim["loss_last10_mean"] < sim["loss_first_step"] - 2.0, sim
    assert real["trained"]["tau"] > real["untrained"]["tau"] + 1.0, (real["trained"]["tau"], real["untrained"]["tau"])
    assert real["trained"]["tau"] > 2.0, real["trained"]["tau"]
    assert real["trained"]["acceptance_unconditional"][0] > real["untrained"]["acceptance_unconditional"][0] + 0.1

    # Lossless: every speculative output equals plain greedy decoding, trained or not.
    for name, r in real.items():
        assert r["lossless_mismatches"] == 0, (name, r["mismatch_examples"])
