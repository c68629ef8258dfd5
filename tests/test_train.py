"""Trainer on a tiny random target: the loss falls, the target stays bit-identical, resume is exact (in process,
after a damaged checkpoint, after kill -9), NaN stops the run, and an 8-device mesh gives 1-device numbers.

One 30-step run (checkpoints at 10, 20, 30) is shared; every other test restarts from a copy of its run
directory, so the compiled step is reused (same Program) and the file costs one compilation in process.
"""

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import REPO
from flax import nnx
from trainer_probes import loss_and_grads

from train.config import load_config
from train.trainer import TrainingDiverged, open_trainer
from train.workflow import export_run


def _records(run_dir):
    return [json.loads(ln) for ln in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def _params(model):
    return {p: np.array(v.get_value()) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}


@pytest.fixture(scope="module")
def run30(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run30")
    # This run's executables go to a persistent cache that the kill -9 test's subprocesses read, so they load
    # the step instead of compiling it twice more (the cache is off for the rest of the session).
    from jax._src import compilation_cache

    cache = run_dir.parent / "jax_cache"
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()
    try:
        tr = open_trainer(load_config("tiny", [f"run_dir={run_dir}"]))
        before = _params(tr.run.target)
        summary = tr.train()
        export_run(tr)  # what train/run.py does after a finished run
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()
    return run_dir, tr, before, summary, cache


def _copy(run30, tmp_path, keep_steps):
    src = run30[0]
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    for d in (dst / "checkpoints").iterdir():
        if d.name.isdigit() and int(d.name) not in keep_steps:
            shutil.rmtree(d)
    return dst


def test_loss_falls_and_target_frozen(run30):
    run_dir, tr, before, summary, _ = run30
    recs = _records(run_dir)
    assert [r["step"] for r in recs] == list(range(1, 31))
    first, last = recs[0]["loss"], np.mean([r["loss"] for r in recs[-5:]])
    # Seen: 6.67 -> about 5.1 (log 512 = 6.24 at random; the synthetic cycles make blocks predictable).
    assert first - last > 1.0, (first, last)
    after = _params(tr.run.target)
    assert before.keys() == after.keys()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert summary["step"] == 30 and summary["tokens_per_s"] > 0
    assert (run_dir / "export" / "config.json").is_file() and (run_dir / "export" / "model.safetensors").is_file()
    assert len(recs[0]["acc"]) == 7  # K-1 per-position accuracies
    assert not (run_dir / "profile").exists()  # log.profile_steps is 0 by default


def test_resume_is_exact(run30, tmp_path):
    """A new Trainer restored from step 10 redoes steps 11..30 with bit-identical losses."""
    run_dir = _copy(run30, tmp_path, keep_steps={10})
    tr = open_trainer(load_config("tiny", [f"run_dir={run_dir}"]))
    assert tr.restored_step == 10 and [r["step"] for r in _records(run_dir)] == list(range(1, 11))
    tr.train()
    assert [r["loss"] for r in _records(run_dir)] == [r["loss"] for r in _records(run30[0])]


def test_damaged_latest_checkpoint_falls_back(run30, tmp_path):
    run_dir = _copy(run30, tmp_path, keep_steps={20, 30})
    for f in (run_dir / "checkpoints" / "30" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\0garbage")
    with pytest.warns(UserWarning, match="step 30 .* unreadable.*falling back"):
        tr = open_trainer(load_config("tiny", [f"run_dir={run_dir}"]))
    assert tr.restored_step == 20
    tr.train(max_steps=3)
    assert [r["loss"] for r in _records(run_dir)] == [r["loss"] for r in _records(run30[0])][:23]
    # The damaged step is set aside (kept, not deleted), so it does not block saving step 30 again.
    assert [d.name.split("-")[0] for d in (run_dir / "checkpoints" / "damaged").iterdir()] == ["30"]
    tr.train()
    assert tr.checkpoints.latest_step() == 30
    assert open_trainer(load_config("tiny", [f"run_dir={run_dir}"])).restored_step == 30


def test_resume_refuses_a_different_drafter_and_keeps_the_checkpoints(run30, tmp_path):
    """A changed drafter architecture is a config change, not damage: refused by name, nothing deleted or moved."""
    run_dir = _copy(run30, tmp_path, keep_steps={20, 30})
    with pytest.raises(ValueError, match=r"drafter num_hidden_layers=2 in the checkpoint but 3 now"):
        open_trainer(load_config("tiny", [f"run_dir={run_dir}", "drafter.num_layers=3"]))
    assert sorted(d.name for d in (run_dir / "checkpoints").iterdir() if d.name.isdigit()) == ["20", "30"]
    assert not (run_dir / "checkpoints" / "damaged").exists()


def test_more_steps_on_a_finished_run_say_what_the_schedule_does(run30, tmp_path, caplog):
    run_dir = _copy(run30, tmp_path, keep_steps={30})
    with caplog.at_level("WARNING", logger="dflash.train"):
        tr = open_trainer(load_config("tiny", [f"run_dir={run_dir}", "train.steps=60", "train.epochs=6"]))
    assert tr.restored_step == 30
    assert re.search(r"train.steps is 60 now, 30 when step 30 was saved.*moves from \S+ to \S+", caplog.text)


def test_a_torn_metrics_line_is_dropped_on_restore(run30, tmp_path):
    run_dir = _copy(run30, tmp_path, keep_steps={30})
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 31, "loss": 1.2')  # killed mid-write
    open_trainer(load_config("tiny", [f"run_dir={run_dir}"]))
    assert [r["step"] for r in _records(run_dir)] == list(range(1, 31))


def test_a_second_training_in_one_run_dir_is_refused(tmp_path):
    """The run_dir lock refuses a second training while one holds it, before the Trainer reads or writes anything
    there (tests/test_bad_inputs_boundary.py checks the bytes), and dies with its holder (kill -9)."""
    from dflash_model.files import RunLock

    run_dir = tmp_path / "locked"
    held = RunLock(run_dir)
    with pytest.raises(RuntimeError, match=rf"{run_dir} is being trained by pid {os.getpid()}"):
        open_trainer(load_config("tiny", [f"run_dir={run_dir}"]), restore=False)
    held.release()
    tr = open_trainer(load_config("tiny", [f"run_dir={run_dir}"]), restore=False)
    with pytest.raises(RuntimeError, match="is being trained by"):  # the Trainer holds it until it has trained
        RunLock(run_dir)
    tr.train(max_steps=1)
    assert tr.step == 1
    code = (
        "import os, signal, sys; from dflash_model.files import RunLock; RunLock(sys.argv[1]); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(run_dir)], cwd=REPO)
    assert proc.returncode == -signal.SIGKILL
    RunLock(run_dir).release()  # the killed holder's lock is gone with it


def test_resume_refuses_a_different_objective(run30, tmp_path):
    """A checkpoint trained at K=8 must not silently continue as K=16 or with another gamma."""
    run_dir = _copy(run30, tmp_path, keep_steps={30})
    with pytest.raises(ValueError, match=r"block_size=8 in the checkpoint but 16 now"):
        open_trainer(load_config("tiny", [f"run_dir={run_dir}", "block_size=16"]))
    with pytest.raises(ValueError, match=r"gamma=4.0 in the checkpoint but 2.5 now"):
        open_trainer(load_config("tiny", [f"run_dir={run_dir}", "gamma=2.5"]))


def test_nan_loss_stops_and_keeps_last_good_checkpoint(run30, tmp_path):
    run_dir = _copy(run30, tmp_path, keep_steps={10})
    tr = open_trainer(load_config("tiny", [f"run_dir={run_dir}", "debug.nan_at_step=13"]))
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 13.*Last good checkpoint: step 10"):
        tr.train()
    assert tr.step == 12 and tr.checkpoints.latest_step() == 10
    assert [r["step"] for r in _records(run_dir)] == list(range(1, 13))
    good = _records(run30[0])[:12]
    assert [r["loss"] for r in _records(run_dir)] == [r["loss"] for r in good]


@pytest.mark.long
def test_sharded_mesh_matches_one_device(tmp_path):
    """data=2 x fsdp=4 (batch over 8 devices, params FSDP-sharded) vs one device: same loss and grads."""
    small = ["target.arch.num_hidden_layers=2", "drafter.num_layers=1", "drafter.target_layer_ids=[0,1]"]
    one = open_trainer(load_config("tiny", [f"run_dir={tmp_path / 'a'}", *small]), restore=False)
    eight = open_trainer(
        load_config("tiny", [f"run_dir={tmp_path / 'b'}", "mesh.data=2", "mesh.fsdp=4", *small]), restore=False
    )
    assert eight.run.mesh.devices.size == 8
    # Adam's mu and nu are sharded like the parameters they track (not replicated on every device).
    params, mu = eight.state["params"], eight.state["opt"][1][0].mu
    sharded = [p.sharding for p in jax.tree.leaves(params) if not p.sharding.is_fully_replicated]
    assert sharded and [m.sharding for m in jax.tree.leaves(mu)] == [p.sharding for p in jax.tree.leaves(params)]
    batch = next(one.iterator)
    loss1, g1 = loss_and_grads(one, batch)
    loss8, g8 = loss_and_grads(eight, batch)
    np.testing.assert_allclose(float(loss8), float(loss1), rtol=1e-5, atol=1e-5)
    flat1, flat8 = jax.tree.leaves(g1), jax.tree.leaves(g8)
    assert len(flat1) == len(flat8)
    for a, b in zip(flat1, flat8):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


def test_sigterm_checkpoints_and_stops(run30, tmp_path, monkeypatch):
    """SIGTERM (preemption) mid-run: the step in flight finishes, is checkpointed, and train() returns."""
    import train.trainer as trainer_mod

    run_dir = _copy(run30, tmp_path, keep_steps={10})
    tr = open_trainer(load_config("tiny", [f"run_dir={run_dir}", "debug.sleep_per_step=0.01"]))
    monkeypatch.setattr(trainer_mod, "_pause", lambda _s: os.kill(os.getpid(), signal.SIGTERM))
    summary = tr.train()
    assert summary["stopped_by"] == "SIGTERM" and summary["step"] == 11
    assert tr.checkpoints.latest_step() == 11 and "export" not in summary
    assert signal.getsignal(signal.SIGTERM) is not None  # the previous handler is back


@pytest.mark.slow
def test_kill9_then_restart_reproduces_losses(run30, tmp_path):
    """train/run.py killed with SIGKILL after its step-10 checkpoint, then restarted, logs the losses of the
    uninterrupted in-process run bit for bit (same program on device 0 of 8 fake CPU devices)."""
    run_dir = tmp_path / "killed"
    # The in-process run's compile cache (see run30): both processes load the step instead of compiling it.
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": "8",
        "JAX_COMPILATION_CACHE_DIR": str(run30[4]),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    cmd = [sys.executable, str(REPO / "train" / "run.py"), "--config", "tiny", f"run_dir={run_dir}"]
    proc = subprocess.Popen(
        cmd + ["debug.sleep_per_step=0.5"], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.time() + 150
    while not (run_dir / "checkpoints" / "10").is_dir():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline, "no checkpoint within 150 s"
        time.sleep(0.2)
    time.sleep(1.0)  # let it run past the checkpoint, so the restart has steps to redo
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(_records(run_dir)) < 30
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from step" in done.stderr or "resuming from step" in done.stderr
    assert [r["loss"] for r in _records(run_dir)] == [r["loss"] for r in _records(run30[0])]


@pytest.mark.long
@pytest.mark.slow
def test_offline_features_match_online(run30, tmp_path):
    """Features precomputed once to the cache and read back by record index train like the online path."""
    run_dir = tmp_path / "offline"
    tr = open_trainer(load_config("tiny", [f"run_dir={run_dir}", "features.mode=offline"]), restore=False)
    cache = np.load(run_dir / "features" / "features.npy", mmap_mode="r")
    assert cache.shape == (512, 64, 2 * 64) and json.loads((run_dir / "features" / "meta.json").read_text())
    tr.train(max_steps=3)
    online = [r["loss"] for r in _records(run30[0])[:3]]
    np.testing.assert_allclose([r["loss"] for r in _records(run_dir)], online, rtol=1e-5)
    stamp = (run_dir / "features" / "meta.json").stat().st_mtime_ns
    open_trainer(load_config("tiny", [f"run_dir={run_dir}", "features.mode=offline"]), restore=False)
    assert (run_dir / "features" / "meta.json").stat().st_mtime_ns == stamp  # a complete cache is reused


@pytest.mark.long
def test_distillation_and_loss_positions_reach_the_step(tmp_path):
    """distill_weight and loss_positions reach the compiled step: with P=3 the step reports 3 per-position
    accuracies, and the soft labels change the first step's loss from the same initial drafter (the objective's
    values are checked in test_objective); offline features cannot serve a teacher, which is refused by name."""
    losses = {}
    for w in (0.0, 0.5):
        run_dir = tmp_path / f"w{w}"
        tr = open_trainer(
            load_config("tiny", [f"run_dir={run_dir}", "loss_positions=3", f"distill_weight={w}"]), restore=False
        )
        tr.train(max_steps=1)
        (rec,) = _records(run_dir)
        assert len(rec["acc"]) == 3 and math.isfinite(rec["loss"])
        losses[w] = rec["loss"]
    assert abs(losses[0.5] - losses[0.0]) > 1e-3, losses
    with pytest.raises(ValueError, match="distill_weight=0.5 needs features.mode=online"):
        load_config("tiny", [f"run_dir={tmp_path / 'off'}", "distill_weight=0.5", "features.mode=offline"])


@pytest.mark.long
def test_lr_ratio_scales_each_parameters_update(tmp_path):
    """train.lr_ratio {name part: ratio}: a ratio of 0 leaves the matching weights where they started, and a ratio
    of 0.5 moves a weight by exactly half of what it moves at 1 (Adam's update is per parameter); the rest train as
    without it. Checked after 2 steps from the same start; the config is checked with the key in the CLI's form."""
    moved = {}
    for name, override in (("plain", "train.lr_ratio={}"), ("ratios", "train.lr_ratio={mlp: 0.0, fc: 0.5}")):
        tr = open_trainer(load_config("tiny", [f"run_dir={tmp_path / name}", override]), restore=False)
        start = {k: np.array(v) for k, v in nnx.to_flat_state(tr.state["params"])}
        tr.train(max_steps=2)
        moved[name] = {".".join(map(str, k)): np.array(v) - start[k] for k, v in nnx.to_flat_state(tr.state["params"])}
    plain, ratios = moved["plain"], moved["ratios"]
    mlp = [k for k in plain if ".mlp." in k]
    assert mlp and all(np.abs(plain[k]).max() > 1e-6 for k in mlp)
    assert all(np.abs(ratios[k]).max() == 0.0 for k in mlp), "mlp weights moved at lr_ratio 0"
    fc = [k for k in plain if k.startswith("fc")]
    for k in fc:  # warmup starts at lr 0, so only the second step moves anything, from the same gradient
        np.testing.assert_allclose(ratios[k], 0.5 * plain[k], rtol=1e-5, atol=1e-8)  # fp32 w + u - w
    attn = [k for k in plain if "self_attn" in k]
    assert all(np.abs(ratios[k]).max() > 0.5 * np.abs(plain[k]).max() for k in attn)


def test_drafter_layer_types_from_the_config():
    """drafter.layer_types / sliding_window reach the DrafterConfig (and so the z-lab export); a window without
    a sliding layer, or a list of the wrong length, is refused naming the key."""
    from dflash_model.config import ConfigError, preset
    from dflash_model.drafter_weights import zlab_config
    from train.assembly import drafter_config

    def dcfg(*overrides):
        cfg = load_config("tiny", list(overrides))
        return drafter_config(cfg, preset(cfg.target.preset).replace(**dict(cfg.target.arch)))

    assert dcfg().layer_types is None and dcfg().sliding_window is None
    mixed = dcfg("drafter.layer_types=[sliding_attention,full_attention]", "drafter.sliding_window=4")
    assert mixed.layer_types == ("sliding_attention", "full_attention") and mixed.sliding_window == 4
    assert zlab_config(mixed)["layer_types"] == ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="drafter.sliding_window=4 needs drafter.layer_types"):
        dcfg("drafter.sliding_window=4")
    with pytest.raises(ConfigError, match="layer_types has 1 entries for num_hidden_layers=2"):
        dcfg("drafter.layer_types=[sliding_attention]")


def test_drafter_init_starts_from_an_exported_drafter(run30, tmp_path):
    """drafter.init loads a z-lab export's weights in place of the random init (a different K is fine: the weights
    do not depend on it); another architecture is refused naming the key and the field."""
    from dflash_model.drafter_weights import load_drafter

    export = run30[0] / "export"
    _, exported = load_drafter(export, dtype="float32")
    tr = open_trainer(
        load_config("tiny", [f"run_dir={tmp_path / 'ft'}", f"drafter.init={export}", "block_size=4", "seed=1"]),
        restore=False,
    )
    fresh = open_trainer(load_config("tiny", [f"run_dir={tmp_path / 'fresh'}", "seed=1"]), restore=False)
    got, want, control = _params(tr.drafter()), _params(exported), _params(fresh.drafter())
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))
    assert max(float(np.abs(control[k] - want[k]).max()) for k in want) > 1e-2  # the seed alone gives other weights
    with pytest.raises(ValueError, match=r"drafter.init=.*num_hidden_layers"):
        open_trainer(
            load_config(
                "tiny",
                [
                    f"run_dir={tmp_path / 'bad'}",
                    f"drafter.init={export}",
                    "drafter.num_layers=1",
                    "drafter.target_layer_ids=[0, 2]",
                ],
            ),
            restore=False,
        )


@pytest.mark.long
def test_drafter_init_layers_grows_an_export_that_drafts_the_same(run30, tmp_path):
    """drafter.init_layers=[0, null, 1, null]: layers 0 and 2 are the export's 0 and 1, the new layers start as the
    identity (o_proj and down_proj zero, their other weights random), so the grown drafter's block hidden equals
    the export's; a mapping that does not fit is refused naming the key."""
    import jax.numpy as jnp

    from dflash_model.drafter import train_logits
    from dflash_model.drafter_weights import load_drafter

    export = run30[0] / "export"
    _, exported = load_drafter(export, dtype="float32")
    grow = ["drafter.num_layers=4", "drafter.init_layers=[0, null, 1, null]"]
    tr = open_trainer(
        load_config("tiny", [f"run_dir={tmp_path / 'grow'}", f"drafter.init={export}", "seed=1", *grow]),
        restore=False,
    )
    grown, want = _params(tr.drafter()), _params(exported)
    for k, v in want.items():
        name = ".".join(map(str, k))
        mapped = tuple(p if i != 1 or k[0] != "layers" else {0: 0, 1: 2}[p] for i, p in enumerate(k))
        np.testing.assert_array_equal(grown[mapped], v, err_msg=name)
    for layer in (1, 3):
        new = {k: v for k, v in grown.items() if k[:2] == ("layers", layer)}
        zero = [k for k in new if k[-1] in ("o_proj", "down_proj")]
        assert len(zero) == 2 and all(np.abs(new[k]).max() == 0.0 for k in zero)
        assert all(np.abs(new[k]).max() > 1e-3 for k in new if k not in zero)  # the rest keep their random init

    rng = np.random.default_rng(0)
    tcfg = tr.run.target_cfg
    tokens = jnp.asarray(rng.integers(0, tcfg.vocab_size - 1, (2, 32)), jnp.int32)
    feats = jnp.asarray(rng.standard_normal((2, 32, exported.fc.get_value().shape[0])), jnp.float32)
    anchors = jnp.asarray([[3, 10, 20], [5, 12, 22]], jnp.int32)
    hid = lambda d: np.asarray(train_logits(d, tr.run.target, feats, tokens, anchors, 8, hidden_only=True))
    np.testing.assert_allclose(hid(tr.drafter()), hid(exported), rtol=1e-5, atol=1e-5)

    bad = {
        "drafter.init_layers=[0, null, 2, null]": r"entry 2 is 2, not null or a layer of drafter.init=.*\(0..1\)",
        "drafter.init_layers=[0, 1]": r"2 entries for drafter.num_layers=4",
    }
    for override, msg in bad.items():
        with pytest.raises(ValueError, match=msg):
            open_trainer(
                load_config("tiny", [f"run_dir={tmp_path / 'bad'}", f"drafter.init={export}", *grow, override]),
                restore=False,
            )
    with pytest.raises(ValueError, match=r"drafter.init_layers=.*needs drafter.init to name a drafter directory"):
        open_trainer(load_config("tiny", [f"run_dir={tmp_path / 'bad2'}", *grow]), restore=False)


def test_grown_config_keeps_the_loaded_layer_types_and_window():
    """drafter.init_layers over a [sliding, full] drafter: the recipe's mapping fits; a mapping that puts a sliding
    layer where the run has a full one, or a run with another window, is refused or differs (never silently
    re-masked)."""
    from dflash_model.config import preset
    from train.assembly import drafter_config
    from train.starts import _grown_config

    def dcfg(*overrides):
        cfg = load_config("tiny", list(overrides))
        return drafter_config(cfg, preset(cfg.target.preset).replace(**dict(cfg.target.arch)))

    loaded = dcfg("drafter.layer_types=[sliding_attention,full_attention]", "drafter.sliding_window=2")
    types = "drafter.layer_types=[sliding_attention,full_attention,full_attention,full_attention]"
    run = dcfg("drafter.num_layers=4", types, "drafter.sliding_window=2")
    assert _grown_config(loaded, run, [0, None, 1, None], "DIR") == run
    with pytest.raises(ValueError, match=r"layer 0 is sliding_attention but drafter.init=DIR's layer 1 is full"):
        _grown_config(loaded, run, [1, None, 0, None], "DIR")
    with pytest.raises(ValueError, match=r"entry 1 is True"):
        _grown_config(loaded, run, [0, True, 1, None], "DIR")
    wider = dcfg("drafter.num_layers=4", types, "drafter.sliding_window=4")
    assert _grown_config(loaded, wider, [0, None, 1, None], "DIR").sliding_window == 2  # differs: refused


def test_offline_features_are_keyed_by_the_token_ids(run30, tmp_path):
    """The feature cache is rebuilt when a record's tokens change (an edited data file under the same name) and
    reused when they do not."""
    from train.features import open_or_build

    tr = run30[1]
    rng = np.random.default_rng(0)
    records = [{"input_ids": rng.integers(0, 500, 64)} for _ in range(8)]
    root = tmp_path / "feats"
    cfg = tr.cfg
    run = dataclasses.replace(
        tr.run, cfg=dataclasses.replace(cfg, features=dataclasses.replace(cfg.features, cache_dir=str(root)))
    )
    first, _ = open_or_build(run, records)
    stamp = (root / "meta.json").stat().st_mtime_ns
    open_or_build(run, records)
    assert (root / "meta.json").stat().st_mtime_ns == stamp
    records[3] = {"input_ids": np.where(np.arange(64) == 5, 7, records[3]["input_ids"])}
    edited, _ = open_or_build(run, records)
    assert (root / "meta.json").stat().st_mtime_ns != stamp
    assert not np.allclose(first[3], edited[3]) and np.allclose(first[2], edited[2])


def test_token_ids_beyond_the_target_vocabulary_are_refused_before_training():
    """A tokenizer larger than the target's vocabulary once showed up as 'loss is nan at step 1'."""
    from data.pipeline import TokenizedRecords
    from train.assembly import check_token_ids

    cfg = load_config("tiny")
    ok = TokenizedRecords.from_examples([{"input_ids": [1, 2, 511], "loss_mask": [0, 1, 1]}])
    check_token_ids(ok, 512, cfg)
    bad = TokenizedRecords.from_examples(
        [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [4, 600, 5], "loss_mask": [0, 1, 1]}]
    )
    with pytest.raises(ValueError, match=r"token id 600 .* outside the target's vocabulary 0..511"):
        check_token_ids(bad, 512, cfg)


def test_rows_longer_than_the_target_positions_are_refused(tmp_path):
    with pytest.raises(ValueError, match="train.max_len=4096 exceeds the target's max_position_embeddings=2048"):
        open_trainer(load_config("tiny", [f"run_dir={tmp_path}", "train.max_len=4096"]), restore=False)


def _tb_scalars(tb_dir):
    """{tag: [(step, value)]} read back from tensorboardX event files (TFRecord framing, event protos)."""
    import struct

    from tensorboardX.proto import event_pb2

    out = {}
    for f in sorted(Path(tb_dir).glob("events.out.tfevents.*")):
        data, i = f.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            ev = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def test_tensorboard_logs_and_a_profile_appear(tmp_path):
    """log.tensorboard=true writes scalars a TensorBoard reads: the same losses as metrics.jsonl; log.profile_steps
    writes a jax.profiler trace of step 2 (a run without it writes none: test_loss_falls_and_target_frozen)."""
    overrides = [f"run_dir={tmp_path}", "log.tensorboard=true", "log.profile_steps=1", "log.profile_start=2"]
    tr = open_trainer(load_config("tiny", overrides), restore=False)
    tr.train(max_steps=3)
    traces = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 1000, traces
    scalars = _tb_scalars(tmp_path / "tb")
    losses = [(r["step"], r["loss"]) for r in _records(tmp_path)]
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3]
    np.testing.assert_allclose([v for _, v in scalars["train/loss"]], [v for _, v in losses], rtol=1e-6)
    assert {"train/sim_tau", "train/lr", "train/grad_norm"} <= set(scalars)


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    """train/run.py reports a bad value as one line naming it, exit 2, no traceback (DFLASH_TRACEBACK=1 shows it)."""
    cmd = [sys.executable, str(REPO / "train" / "run.py"), "--config", "tiny", f"run_dir={tmp_path}", "train.lr=-1"]
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_TRACEBACK"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: train.lr=-1: must be > 0" in proc.stderr and "Traceback" not in proc.stderr
    helped = subprocess.run(
        [sys.executable, str(REPO / "train" / "run.py"), "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert helped.returncode == 0 and "--config" in helped.stdout and "--block" in helped.stdout


def test_labelled_positions_are_counted_as_the_step_counts_them(tmp_path):
    """train.assembly.labelled_positions, counted from the pipeline with no model step, equals the valid_labels each
    trained step logs, batch for batch (a draft vocabulary and a loss_positions cut included), so a budget of
    labelled positions can be met exactly."""
    import json

    from train.assembly import build_run, labelled_positions

    over = ["train.steps=4", "checkpoint.every_steps=100", "log.tensorboard=false", "draft_vocab=64",
            "loss_positions=5"]  # fmt: skip
    cfg = load_config("tiny", [f"run_dir={tmp_path / 'run'}", *over])
    counted = labelled_positions(build_run(load_config("tiny", [f"run_dir={tmp_path / 'count'}", *over]),
                                           tmp_path / "count"), 4)  # fmt: skip
    tr = open_trainer(cfg)
    tr.train()
    logged = [json.loads(line)["valid_labels"] for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert counted == logged and len(set(counted)) > 1 and min(counted) > 0
