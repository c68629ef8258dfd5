"""Bad inputs at the boundary (docs/bad-inputs.md): every length checked where it enters, against the target's
positions and a stated bound, before any weights load or anything compiles; every damaged file named (and a cache
rebuilt); a refused training changes no file; an unreachable gs:// run_dir is refused within seconds."""

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import FIXTURES, REPO

from dflash_model.weights import load_target_config
from infer import eval as ev
from infer import eval_sets, generate, loading
from infer.loading import load_draft_spec
from infer.replies import load_replies, save_replies
from infer.target_spec import load_target_spec

TINY = str(FIXTURES / "tiny_qwen3")  # 2048 positions, a vocabulary of 512


@pytest.fixture
def no_weights(monkeypatch):
    """The target's weights may not load: a refusal that comes after them fails the test."""

    def refuse(*a, **k):
        raise AssertionError("the target's weights were loaded before the input was checked")

    monkeypatch.setattr("infer.target_spec.load_target", refuse)


@pytest.fixture(scope="module")
def tiny_cfg():
    return load_target_config(TINY)


def _eval_args(tmp_path, prompts, *extra):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt_ids": p}) + "\n" for i, p in enumerate(prompts)))
    return ["--target", TINY, "--dataset", str(data), "--out", str(tmp_path / "o"), *extra]


# -- lengths -----------------------------------------------------------------------------------------------------


def test_block_and_tree_sizes_have_an_upper_bound(tiny_cfg, tmp_path, capsys):
    """K = 100000 (or a tree of 100000 nodes) compiled for minutes while memory grew; now K <= 1024 and nodes <= 1024,
    refused by name before a reply file or drafter is read."""
    with pytest.raises(SystemExit) as exc:
        ev.parse_args(_eval_args(tmp_path, [[1, 2]], "--draft", "ngram", "--block", "100000", "--max-new-tokens", "4"))
    assert exc.value.code == 2 and "argument --block: 100000 is more than 1024" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--draft 'ngram': block size K=100000 is outside 1..1024"):
        loading.load_drafts(["ngram@100000"], tiny_cfg, None, 0)
    with pytest.raises(ValueError, match=r"lookuptree100000:.*a draft tree of 100000 nodes; give 1..1024"):
        load_draft_spec(f"lookuptree100000:{tmp_path / 'no-such.npz'}", tiny_cfg)
    with pytest.raises(ValueError, match=r"a draft tree of 5000 nodes; give 1..1024"):
        load_draft_spec("tree5000:random", tiny_cfg)
    from infer.engine import Engine
    from infer.proposers import NGramProposer

    tiny = load_target_spec(TINY).model
    with pytest.raises(ValueError, match="block size K=2000 is more than 1024"):
        Engine(tiny, NGramProposer(), block_size=2000, max_new_tokens=4)


def test_lengths_past_the_target_positions_are_refused_before_the_weights_load(tmp_path, no_weights):
    """2040 prompt tokens + 64 new ones, or 4 + 3000, on a 2048-position target decoded silently past its positions;
    now refused with the numbers before the weights load (and by the engine itself)."""
    with pytest.raises(ValueError, match=r"1000000000 new tokens .* more than the target's 2048"):
        generate.main(["--target", TINY, "--prompt-ids", "1,2,3", "--max-new-tokens", "1000000000"])
    with pytest.raises(ValueError, match=r"--max-new-tokens: a prompt of 1 \+ 3000 new tokens"):
        ev.main(_eval_args(tmp_path, [[1, 2, 3, 4]], "--draft", "ngram", "--max-new-tokens", "3000"))
    long = [int(t) for t in np.arange(2040) % 500]
    want = r"prompt p1: a prompt of 2040 \+ 64 new tokens \+ a verify of 8 = 2112 positions, more than .* 2048"
    with pytest.raises(ValueError, match=want):
        ev.main(_eval_args(tmp_path, [[5, 6], long], "--draft", "ngram", "--max-new-tokens", "64"))
    with pytest.raises(ValueError, match=r"--prompt-ids: a prompt of 2040 \+ 64 new tokens \+ a verify of 1 = 2105"):
        generate.main(["--target", TINY, "--prompt-ids", ",".join(map(str, long))] + ["--max-new-tokens", "64"])


def test_the_engine_refuses_a_decode_past_the_target_positions():
    from infer.engine import Engine

    tiny = load_target_spec(TINY).model
    with pytest.raises(ValueError, match=r"max_new_tokens: a prompt of 1 \+ 3000 new tokens"):
        Engine(tiny, max_new_tokens=3000)
    engine = Engine(tiny, max_new_tokens=64)
    with pytest.raises(ValueError, match=r"the longest prompt: a prompt of 2040 \+ 64 new tokens"):
        engine.prefill(*engine.inputs([[1] * 2040]))


def test_prompts_are_cut_only_when_asked_and_said(tiny_cfg, tmp_path, capsys):
    """--truncate-prompts keeps each too-long prompt's last tokens that fit, says so, and records it in eval.json."""
    from infer.loading import fit_prompts

    long = list(range(2040))
    with pytest.raises(ValueError, match="a prompt of 2040"):
        fit_prompts([long], tiny_cfg, max_new_tokens=64, width=8, names=["p"])
    (cut,), said = fit_prompts([long], tiny_cfg, max_new_tokens=64, width=8, names=["p"], truncate=True)
    assert cut == long[-1976:] and said == {"p": [2040, 1976]}
    assert "p: cut from 2040 to its last 1976 tokens" in capsys.readouterr().err
    args = ev.parse_args(
        _eval_args(tmp_path, [[1, 2], [t % 500 for t in long]], "--draft", "ngram", "--max-new-tokens", "64")
        + ["--truncate-prompts"]
    )
    sets = ev.checked_inputs(args)[2]
    ((_, prompts, said),) = sets.values()
    assert [len(p) for p in prompts] == [2, 1976] and list(said.values()) == [[2040, 1976]]


# -- files the commands read -------------------------------------------------------------------------------------


def test_an_empty_prompt_file_is_named(tmp_path, no_weights):
    with pytest.raises(ValueError, match=r"--dataset .*p.jsonl: no prompts in it"):
        ev.main(_eval_args(tmp_path, [], "--draft", "ngram", "--max-new-tokens", "4"))


def test_a_non_utf8_data_file_is_named_with_its_line(tmp_path):
    from data.conversations import load_conversations

    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: not UTF-8 \(byte 0xe9 at column 16\)"):
        eval_sets.dataset_messages(str(path))
    with pytest.raises(ValueError, match=rf"{path}:2: not UTF-8"):
        load_conversations(path)
    gz = tmp_path / "cut.jsonl.gz"
    import gzip

    gz.write_bytes(gzip.compress(b'{"prompt": "x"}\n' * 1000)[:60])
    with pytest.raises(ValueError, match=rf"{gz}:\d+: a damaged gzip file"):
        eval_sets.dataset_messages(str(gz))


def _reply_file(path, ids, offsets, vocab=512):
    ids = np.asarray(ids, np.int32)
    save_replies(path, {"input_ids": ids, "loss_mask": np.ones(ids.size, bool), "offsets": np.asarray(offsets)}, vocab)
    return path


def test_damaged_reply_files_are_named(tmp_path):
    """A reply file cut short (was: BadZipFile), with ids outside the vocabulary (was: blamed on the target's weights
    when decoding) or with negative offsets: one error naming the file."""
    good = _reply_file(tmp_path / "good.npz", [1, 2, 3, 4], [0, 2, 4])
    assert load_replies(good, 512)["offsets"].tolist() == [0, 2, 4]
    cut = tmp_path / "cut.npz"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"{cut}: not a reply file"):
        load_replies(cut, 512)
    oov = _reply_file(tmp_path / "oov.npz", [1, 600, 3], [0, 3])
    with pytest.raises(ValueError, match=rf"{oov}: a damaged reply file: token id 600 is outside the vocabulary"):
        load_replies(oov, 512)
    neg = _reply_file(tmp_path / "neg.npz", [1, 2, 3], [0, -5, 3])
    with pytest.raises(ValueError, match=rf"{neg}: a damaged reply file: offsets must rise from 0 .*lowest -5"):
        load_replies(neg, 512)


def test_a_damaged_token_cache_is_named_and_rebuilt(tmp_path, caplog):
    """A token cache cut short (was: `mmap length is greater than file size`, neither named nor rebuilt) or with a
    torn ids.json: a warning naming it, and the records tokenized again."""
    from data import pipeline
    from dflash_model.tokenizer import load_tokenizer

    tok = load_tokenizer(FIXTURES / "think_tokenizer")
    recs = [
        {
            "id": f"c{i}",
            "messages": [{"role": "user", "content": f"Q {i}?"}, {"role": "assistant", "content": f"A {i}"}],
        }
        for i in range(3)
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    first = pipeline.load_tokenized(path, tok, 64)
    want = [first[i]["input_ids"].tolist() for i in range(len(first))]
    (cache,) = tmp_path.glob("train.jsonl.tok-*")
    for damage in ("input_ids.npy", "ids.json"):
        f = cache / damage
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        caplog.clear()
        again = pipeline.load_tokenized(path, tok, 64)
        assert f"the token cache {cache} is damaged" in caplog.text and "rebuilding it" in caplog.text, damage
        assert [again[i]["input_ids"].tolist() for i in range(len(again))] == want


def test_a_damaged_feature_cache_is_named_and_rebuilt(tmp_path, caplog):
    """An offline-feature cache with its features.npy cut short (was: mmap length error at the first batch) or a
    torn meta.json (was: a JSONDecodeError, though a damaged cache is said to be rebuilt): named, and rebuilt."""
    from train.features import cache_problem

    want = {"num_records": 4, "max_len": 8, "layer_ids": [0, 1], "hidden_size": 4, "labels": "text"}
    root = tmp_path / "features"
    root.mkdir()
    np.save(root / "features.npy", np.zeros((4, 8, 8), np.float32))
    (root / "meta.json").write_text(json.dumps(want))
    assert cache_problem(root, want) is None
    assert cache_problem(root, {**want, "max_len": 16}) == "made for other settings"
    data = root / "features.npy"
    data.write_bytes(data.read_bytes()[:200])
    assert cache_problem(root, want).startswith("damaged")
    assert f"the offline feature cache {root} is damaged" in caplog.text and "rebuilding it" in caplog.text
    np.save(root / "features.npy", np.zeros((4, 8, 8), np.float32))
    (root / "meta.json").write_text(json.dumps(want)[:10])
    assert cache_problem(root, want).startswith("damaged")


def test_a_truncated_feature_cache_is_rebuilt_by_the_trainer(tmp_path, caplog):
    from train.config import load_config
    from train.trainer import open_trainer

    keys = [f"run_dir={tmp_path / 'run'}", "features.mode=offline", "data.num_records=16", "train.batch_size=8"]
    keys.append("train.steps=2")
    open_trainer(load_config("tiny", keys), restore=False)
    data = tmp_path / "run" / "features" / "features.npy"
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[: size // 3])
    tr = open_trainer(load_config("tiny", keys), restore=False)
    assert "is damaged" in caplog.text and data.stat().st_size == size
    assert tr.run.features[np.arange(16)].shape[0] == 16


# -- draft specs and flags ---------------------------------------------------------------------------------------


def test_draft_specs_that_name_nothing_are_refused_by_name(tiny_cfg, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"--draft 'hybrid:': hybrid: needs a drafter spec"):
        load_draft_spec("hybrid:", tiny_cfg)
    with pytest.raises(ValueError, match=r"--draft 'tree:': tree: needs a drafter directory"):
        load_draft_spec("tree:", tiny_cfg)
    with pytest.raises(ValueError, match=r"--draft 'ngram@abc': the block size after '@' must be a whole number"):
        loading.load_drafts(["ngram@abc"], tiny_cfg, None, 0)
    with pytest.raises(SystemExit) as exc:
        ev.parse_args(_eval_args(tmp_path, [[1]], "--compare", "ngram", "--max-new-tokens", "4"))
    assert exc.value.code == 2 and "argument --compare: 'ngram' is not a drafter directory" in capsys.readouterr().err


# -- regeneration ------------------------------------------------------------------------------------------------


@pytest.fixture
def no_regen_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("train.regenerate.load", refuse)


@pytest.mark.parametrize("flag", ["--max-new-tokens", "--batch-size"])
def test_regeneration_counts_of_zero_are_refused_by_argparse(flag, tmp_path, no_regen_model, capsys):
    from train import regenerate

    args = ["--target", TINY, "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"), flag, "0"]
    with pytest.raises(SystemExit) as exc:
        regenerate.main(args)
    assert exc.value.code == 2 and f"argument {flag}: 0 is less than 1" in capsys.readouterr().err


def test_regeneration_outputs_and_lengths_are_checked_before_the_model_loads(tmp_path, no_regen_model):
    from train import regenerate

    base = ["--target", TINY, "--input", str(tmp_path / "in.jsonl")]
    out_dir = tmp_path / "outdir"
    out_dir.mkdir()
    with pytest.raises(ValueError, match=rf"--output {out_dir}/: a directory"):
        regenerate.main(base + ["--output", f"{out_dir}/"])
    with pytest.raises(ValueError, match=r"--output /proc/replies.jsonl: cannot be written"):
        regenerate.main(base + ["--output", "/proc/replies.jsonl"])  # unwritable even to root
    with pytest.raises(ValueError, match=r"max_prompt_tokens=2000 \+ max_new_tokens=100 = 2100 .* the target's 2048"):
        regenerate.main(
            base + ["--output", str(tmp_path / "o.jsonl"), "--max-prompt-tokens", "2000"] + ["--max-new-tokens", "100"]
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outdir"] and not any(out_dir.iterdir())


# -- the training run directory ----------------------------------------------------------------------------------


def _bytes(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_refused_training_changes_no_file(tmp_path):
    """A second training in a locked run_dir once rewrote config.yml (and trimmed metrics.jsonl) before the lock
    refused it; now the lock comes first and every byte in the directory stays as it was."""
    from dflash_model.files import RunLock
    from train.config import load_config
    from train.run import main
    from train.trainer import open_trainer

    run_dir = tmp_path / "run"
    held = RunLock(run_dir)
    (run_dir / "config.yml").write_text("the running training's config\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')  # its line being written
    before = _bytes(run_dir)
    with pytest.raises(RuntimeError, match=rf"{run_dir} is being trained by pid {os.getpid()}"):
        main(["--config", "tiny", f"run_dir={run_dir}", "train.steps=2"])
    with pytest.raises(RuntimeError, match="is being trained by"):
        open_trainer(load_config("tiny", [f"run_dir={run_dir}"]))
    assert _bytes(run_dir) == before
    held.release()


class _Stalled(Exception):
    pass


@pytest.fixture
def gcs(monkeypatch):
    """gs:// served by a filesystem that answers nothing (`hang`) or refuses (`deny`), as gcsfs does without
    network or credentials."""
    from etils.epath import backend
    from fsspec.implementations.memory import MemoryFileSystem

    release = threading.Event()

    class Unreachable(MemoryFileSystem):
        protocol = ("gs", "gcs")
        mode = "hang"

        def __init__(self, *args, finalize_on_close=None, **kwargs):
            super().__init__(*args, **kwargs)

        def _answer(self):
            if Unreachable.mode == "hang":
                release.wait(15)
                raise _Stalled("released at teardown")
            raise PermissionError("Anonymous caller does not have storage.objects.list access to the bucket")

        def exists(self, path, **kwargs):
            self._answer()

        def info(self, path, **kwargs):
            self._answer()

    for name in ("gs", "gcs"):
        monkeypatch.setitem(sys.modules["fsspec.registry"]._registry, name, Unreachable)
    monkeypatch.setattr("dflash_model.files.PROBE_TIMEOUT_S", 1.0, raising=False)
    backend.fsspec_backend._get_filesystem.cache_clear()
    yield Unreachable
    release.set()
    backend.fsspec_backend._get_filesystem.cache_clear()


@pytest.mark.parametrize(
    "mode, said",
    [("hang", "its store did not answer within 1 s"), ("deny", "PermissionError: Anonymous caller does not have")],
)
def test_an_unreachable_uri_run_dir_is_refused_at_start(gcs, mode, said, tmp_path, monkeypatch):
    """run_dir=gs://... without network or credentials: a gcsfs traceback after ~1 min; now refused at start with
    the URI and the reason, within seconds, before the target loads."""
    from train.run import main

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("train.assembly.load_target_model", lambda *a, **k: pytest.fail("the target loaded"))
    gcs.mode = mode
    t = time.perf_counter()
    with pytest.raises(ValueError, match=rf"run_dir=gs://bucket/run: .*{said}"):
        main(["--config", "tiny", "run_dir=gs://bucket/run"])
    assert time.perf_counter() - t < 10


# -- config values read late -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, said",
    [
        ("eval.prompts=/no/such/prompts.jsonl", r"eval.prompts='/no/such/prompts.jsonl': no such file"),
        ("eval.shipped=/no/such/drafter", r"eval.shipped='/no/such/drafter': no drafter directory there"),
        ("eval.block=16", r"eval.block=16: more than the trained block_size=8"),
        ("eval.ngram_block=100000", r"eval.ngram_block=100000: must be <= 1024"),
    ],
)
def test_config_values_used_late_are_checked_when_it_is_read(override, said):
    from train.config import load_config

    with pytest.raises(ValueError, match=said):
        load_config("tiny", ["eval.enabled=true", override])
    for name in ("heldout", "humaneval", "gsm8k", "mtbench"):  # names, not files
        load_config("tiny", ["eval.enabled=true", f"eval.prompts={name}"])
    with pytest.raises(ValueError, match=r"data.regenerate.prompts='/no/such.jsonl': no such file"):
        load_config("tiny", ["data.source=regenerate", "data.regenerate.prompts=/no/such.jsonl"])


# -- the command lines -------------------------------------------------------------------------------------------


def test_each_command_refuses_in_one_line_with_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_TRACEBACK"}
    env["JAX_PLATFORMS"] = "cpu"
    cases = [
        (["infer.generate", "--target", TINY, "--prompt-ids", "1,2", "--max-new-tokens", "1000000000"], "2048"),
        (
            ["train.regenerate", "--target", TINY, "--input", "x.jsonl", "--output", f"{tmp_path}/"],
            "a directory",
        ),
    ]
    for args, said in cases:
        proc = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, cwd=REPO)
        assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-1500:]


def test_eval_defaults_to_the_published_length_and_refuses_thinking_a_template_lacks(tmp_path):
    """--max-new-tokens defaults to 2048 (z-lab's benchmark setting); --thinking on needs the chat template's own
    enable_thinking switch, and SmolLM2's has none: refused by name before any weight loads."""
    args = ev.parse_args(["--target", "smollm2", "--draft", "ngram", "--dataset", "gsm8k", "--out", str(tmp_path)])
    assert args.max_new_tokens == 2048 and args.thinking == "off"
    args = ev.parse_args(
        ["--target", "smollm2", "--draft", "ngram", "--dataset", "gsm8k", "--out", str(tmp_path), "--thinking", "on"]
    )
    with pytest.raises(ValueError, match="--thinking on: the chat template of --target smollm2 has no enable_thinking"):
        ev.checked_inputs(args)
