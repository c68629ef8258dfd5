"""Scale-out on JAX multi-controller: two `train/run.py` processes on localhost joined by jax.distributed (gloo CPU
collectives, one CPU device each, the drafter FSDP-sharded over both) train the tiny config with the losses of one
process on two devices. Every process writes its checkpoint shards (the checkpoint restores whole in one process);
only process 0 writes metrics.jsonl, config.yml and the export.

The global batch must not depend on the process count: the data tests below check that the rows the hosts read
at a step are, together, the rows one host reads at that step (synthetic and conversation sources).
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import REPO

from data.pipeline import TokenizedRecords, build_dataset
from train.config import load_config
from train.trainer import open_trainer
from train.workflow import export_run

STEPS = 5
# Smaller than tiny (2 target layers, 1 drafter layer): three compilations of the step share 2 CPU cores.
OVERRIDES = [
    "target.arch.num_hidden_layers=2",
    "drafter.num_layers=1",
    "drafter.target_layer_ids=[0,1]",
    f"train.steps={STEPS}",
    "checkpoint.every_steps=2",
    "mesh.data=1",
    "mesh.fsdp=2",
    "log.every=1",
]
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records(run_dir):
    return [json.loads(ln) for ln in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no output)"


def _launch(
    run_dir: Path, logs: Path, num_processes: int = 2, extra: tuple[str, ...] = ()
) -> list[tuple[subprocess.Popen, Path]]:
    port = _free_port()
    procs = []
    for pid in range(num_processes):
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": "1",
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": str(num_processes),
            "JAX_PROCESS_ID": str(pid),
        }
        for k in ("JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS"):  # e.g. a forced host device count: 1 device each
            env.pop(k, None)
        err = logs / f"process{pid}.log"
        cmd = [
            sys.executable,
            str(REPO / "train" / "run.py"),
            "--config",
            "tiny",
            f"run_dir={run_dir}",
            *OVERRIDES,
            *extra,
        ]
        with err.open("wb") as f:  # a file, not a pipe: a full pipe would stall one process and hang the other
            procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT), err))
    return procs


def _wait(procs, deadline: float, ok=(0,)) -> str:
    """Wait for all; on the deadline or a failed process, kill the rest (a lone survivor would wait in a
    collective for its peer) and return every process's output tail for the assertion message."""
    failed = None
    while any(p.poll() is None for p, _ in procs):
        if time.time() > deadline:
            failed = f"timed out after {TIMEOUT_S} s"
            break
        if any(p.poll() not in (None, *ok) for p, _ in procs):
            time.sleep(5)  # let the peer print its own error, then stop it
            failed = "a process failed"
            break
        time.sleep(0.5)
    for p, _ in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    report = "\n".join(f"--- process {i} (rc {p.returncode}) ---\n{_tail(err)}" for i, (p, err) in enumerate(procs))
    if failed is None and any(p.returncode not in ok for p, _ in procs):
        failed = "a process failed"
    return f"{failed}\n{report}" if failed else ""


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
    # One CPU device per process: fsdp=2 fails ("needs 2 devices; 1 available") unless the two form one cluster.
    dist_dir, ref_dir = tmp_path / "two_processes", tmp_path / "one_process"
    prompts = tmp_path / "prompts.jsonl"
    rng = np.random.default_rng(0)
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt_ids": rng.integers(0, 500, 12).tolist()}) + "\n" for i in range(2))
    )
    evaluate = ("eval.enabled=true", f"eval.prompts={prompts}", "eval.max_new_tokens=12", "eval.num_prompts=2")
    t0 = time.time()
    procs = _launch(dist_dir, tmp_path, extra=evaluate)
    try:
        # The reference while they run: this process, the first 2 of its 8 fake devices, the same mesh and batch.
        ref = open_trainer(load_config("tiny", [f"run_dir={ref_dir}", *OVERRIDES]), restore=False)
        assert ref.run.mesh.devices.size == 2 and jax.process_count() == 1
        ref.train()
        export_run(ref)  # what train/run.py does after a finished run
    finally:
        failure = _wait(procs, t0 + TIMEOUT_S)
    assert not failure, failure
    logs = [_tail(err, 10**6) for _, err in procs]

    # Same per-step losses (seen: max relative difference 1.7e-7; the hosts' rows are the same set in another
    # order, so only the summation order differs).
    got, want = _records(dist_dir), _records(ref_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), "metrics.jsonl: one line per step, process 0 only"
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-5, atol=0)
    np.testing.assert_allclose([r["grad_norm"] for r in got], [r["grad_norm"] for r in want], rtol=1e-4)
    # Throughput counts the global batch (both processes' rows), not process 0's half of it.
    assert [round(r["tokens_per_s"] * r["step_s"]) for r in got] == [
        round(r["tokens_per_s"] * r["step_s"]) for r in want
    ]
    assert [round(r["anchors_per_s"] * r["step_s"]) for r in got] == [
        round(r["anchors_per_s"] * r["step_s"]) for r in want
    ]

    # Export and config: written by process 0 only (process 1's summary names no export).
    from safetensors.numpy import load_file

    from dflash_model.drafter_weights import export_drafter

    done = [next(ln for ln in log.splitlines() if " done: " in ln) for log in logs]
    assert "'export'" in done[0] and "'export'" not in done[1], done
    assert (dist_dir / "config.yml").is_file()
    exported = load_file(dist_dir / "export" / "model.safetensors")

    # Checkpoints: saved at 2, 4 and 5 by both processes (each holds half of every FSDP-sharded parameter). The
    # last restores whole in one process and holds exactly the parameters process 0 exported (gathered from both).
    assert sorted(int(d.name) for d in (dist_dir / "checkpoints").iterdir() if d.name.isdigit()) == [2, 4, 5]
    back = open_trainer(load_config("tiny", [f"run_dir={dist_dir}", *OVERRIDES]))
    assert back.restored_step == STEPS
    again = export_drafter(back.drafter(), back.run.drafter_cfg, tmp_path / "from_checkpoint", dtype="float32")
    restored = load_file(again / "model.safetensors")
    assert restored.keys() == exported.keys()
    for k in exported:
        np.testing.assert_array_equal(restored[k], exported[k], err_msg=k)

    # ... and the reference's parameters, up to Adam's amplification of the loss's rounding differences on
    # near-zero gradients (updates are lr-sized whatever the gradient; seen: at most 8e-6 after 5 steps).
    ref_export = load_file(ref_dir / "export" / "model.safetensors")
    assert ref_export.keys() == exported.keys()
    for k in exported:
        np.testing.assert_allclose(exported[k], ref_export[k], rtol=0, atol=1e-4, err_msg=k)

    # The end-of-run eval: process 0 decoded alone with the target gathered onto its own device, the other
    # waited; the same exported drafter through one process's target gives the same acceptance.
    from train.workflow import eval_rows, final_eval

    got_eval = json.loads((dist_dir / "eval" / "eval.json").read_text())
    assert got_eval["trained_steps"] == STEPS and got_eval["num_prompts"] == 2
    assert "eval written to" in logs[0] and "eval written to" not in logs[1]
    one_cfg = load_config("tiny", [f"run_dir={tmp_path / 'eval_one'}", *OVERRIDES, *evaluate])
    one = final_eval(one_cfg, back, None, eval_rows(one_cfg, None), dist_dir / "export")
    for name, rep in got_eval["reports"].items():
        assert rep["lossless_mismatches"] == 0, name
        assert rep["tau"] == one["reports"][name]["tau"], name
        assert rep["decode_tokens_plain"] == one["reports"][name]["decode_tokens_plain"] == 2 * 11, name

    # The data position is the global step (grain's next batch index): one process resumes where two stopped.
    nxt, ref_nxt = next(back.iterator), next(ref.iterator)
    for k in ref_nxt:
        np.testing.assert_array_equal(nxt[k], ref_nxt[k], err_msg=k)


@pytest.mark.long
@pytest.mark.slow
def test_a_signal_to_one_process_stops_both_at_the_same_step(tmp_path):
    """A preemption notice that reaches one process of two: both checkpoint the same step and stop, none hangs.
    (Before the processes agreed on the signal, process 1 stopped to save while process 0 went on to the next
    step, whose all-gather then failed: "Is there a distributed collective mismatch in your code?")"""
    import re
    import signal

    from train.run import STOPPED_EXIT

    run_dir = tmp_path / "run"
    procs = _launch(
        run_dir, tmp_path, extra=("train.steps=60", "checkpoint.every_steps=100", "debug.sleep_per_step=0.2")
    )
    deadline = time.time() + TIMEOUT_S
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.time() < deadline and all(p.poll() is None for p, _ in procs), _wait(procs, deadline)
        time.sleep(0.2)
    os.kill(procs[1][0].pid, signal.SIGTERM)
    failure = _wait(procs, deadline, ok=(STOPPED_EXIT,))
    assert not failure, failure
    assert [p.returncode for p, _ in procs] == [STOPPED_EXIT] * 2  # stopped, not finished: a scheduler sees it
    logs = [_tail(err, 10**6) for _, err in procs]
    stops = [
        re.findall(r"SIGTERM received( by another process)?: checkpointing step (\d+) and stopping", log)
        for log in logs
    ]
    assert [len(s) for s in stops] == [1, 1], stops
    (by_other, step0), (by_self, step1) = stops[0][0], stops[1][0]
    assert by_other and not by_self, stops  # process 0 stopped because process 1 was told to
    step = int(step0)
    assert step == int(step1) and 3 <= step < 60, stops
    assert _records(run_dir)[-1]["step"] == step
    assert sorted(int(d.name) for d in (run_dir / "checkpoints").iterdir() if d.name.isdigit()) == [step]
    assert not (run_dir / "export").exists()  # a stopped run is not finished: no export, no eval


@pytest.mark.long
@pytest.mark.slow
def test_two_processes_build_offline_features_together(tmp_path):
    """features.mode=offline under two processes: the sharded target forward runs on both, process 0 writes the
    cache, and neither reads it before it is complete. The cache and the first losses equal one process's."""
    offline = ("features.mode=offline", "train.steps=2", "export.enabled=false")
    dist_dir, ref_dir = tmp_path / "two_processes", tmp_path / "one_process"
    t0 = time.time()
    procs = _launch(dist_dir, tmp_path, extra=offline)
    try:
        ref = open_trainer(load_config("tiny", [f"run_dir={ref_dir}", *OVERRIDES, *offline]), restore=False)
        ref.train()
    finally:
        failure = _wait(procs, t0 + TIMEOUT_S)
    assert not failure, failure
    got = np.load(dist_dir / "features" / "features.npy")
    want = np.load(ref_dir / "features" / "features.npy")
    assert got.shape == want.shape == (512, 64, 2 * 64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert json.loads((dist_dir / "features" / "meta.json").read_text()) == json.loads(
        (ref_dir / "features" / "meta.json").read_text()
    )
    np.testing.assert_allclose(
        [r["loss"] for r in _records(dist_dir)], [r["loss"] for r in _records(ref_dir)], rtol=1e-5, atol=0
    )


# ----------------------------------------------------------------------------------------------------------
# The global batch does not depend on the process count (the premise of the test above), checked on the data alone.


def _rows(batch) -> list[tuple]:
    return sorted((int(i), tuple(a.tolist())) for i, a in zip(batch["index"], batch["anchors"]))


def test_synthetic_global_batch_is_independent_of_process_count(monkeypatch):
    from train.batches import build_train_dataset

    cfg = load_config("tiny", ["data.num_records=40", "train.epochs=2"])
    kw = {"vocab_size": 512, "mask_token_id": 511}
    one = list(build_train_dataset(cfg, **kw)[0])
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    hosts = []
    for p in range(2):
        monkeypatch.setattr(jax, "process_index", lambda p=p: p)
        hosts.append(list(build_train_dataset(cfg, **kw)[0]))
    assert len(hosts[0]) == len(hosts[1]) == len(one) == 2 * 40 // 8
    for s in range(len(one)):
        assert _rows(one[s]) == sorted(_rows(hosts[0][s]) + _rows(hosts[1][s])), f"step {s}"


def test_conversation_global_batch_is_independent_of_process_count():
    """data.pipeline: same records and anchors per global step on 1 or 2 hosts, across epochs, with a record
    count that is no multiple of the global batch; both hosts get the same number of batches."""
    rng = np.random.default_rng(0)
    examples = []
    for i in range(21):
        t = int(rng.integers(8, 30))
        examples.append({"input_ids": 1000 * i + np.arange(t), "loss_mask": np.arange(t) >= t // 3})
    recs = TokenizedRecords.from_examples(examples, [f"r{i}" for i in range(21)])
    kw = {"max_len": 32, "seed": 3, "num_epochs": 3, "num_anchors": 3, "block_size": 4}
    one = list(build_dataset(recs, None, batch_size=4, shard_index=0, shard_count=1, **kw))
    hosts = [list(build_dataset(recs, None, batch_size=2, shard_index=p, shard_count=2, **kw)) for p in range(2)]
    assert len(hosts[0]) == len(hosts[1]) == len(one) == 63 // 4
    for s in range(len(one)):
        assert _rows(one[s]) == sorted(_rows(hosts[0][s]) + _rows(hosts[1][s])), f"step {s}"


def test_init_distributed_picks_the_cluster_from_the_environment(monkeypatch):
    """An explicit coordinator address wins (the CPU tests' path); on a Cloud TPU VM (platform check mocked) the
    no-argument initialise, which reads the slice from the TPU environment; elsewhere nothing (one process)."""
    from train import run

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(run, "on_cloud_tpu_vm", lambda: False)
    assert run.init_distributed() is False and calls == []
    monkeypatch.setattr(run, "on_cloud_tpu_vm", lambda: True)
    assert run.init_distributed() is True and calls == [((), {})]
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    assert run.init_distributed() is True
    assert calls[-1] == (("10.0.0.1:1234",), {"num_processes": 4, "process_id": 2})


def test_cloud_tpu_vm_is_read_from_the_tpu_environment(monkeypatch):
    from train import run

    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    assert run.on_cloud_tpu_vm() is False  # this CPU machine
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-128")
    assert run.on_cloud_tpu_vm() is True
