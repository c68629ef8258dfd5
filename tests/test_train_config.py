"""Training config: presets load, unknown keys are rejected by name, overrides are typed, --block sets K and
picks a preset's per-K settings."""

import pytest
from conftest import REPO

from train.config import load_config
from train.presets import ConfigKeyError, cli_overrides, parse_value


@pytest.mark.parametrize(
    "name",
    [
        "smollm2-135m",
        "drafters/smollm2-135m-dflash/recipe/long.yml",
        "drafters/smollm2-135m-dflash/recipe/regen.yml",
        "drafters/smollm2-135m-dflash/recipe/more.yml",
        "drafters/smollm2-135m-dflash/recipe/grow.yml",
        "qwen3-4b",
        "qwen3-8b",
        "llama-3.1-8b",
        "tiny",
    ],
)
def test_presets_load(name):
    cfg = load_config(name)
    assert cfg.train.lr > 0 and cfg.block_size >= 2
    assert cfg.checkpoint.max_to_keep >= 2


def test_smollm2_default_is_k64():
    """The main job widens the shipped K=16 drafter to K=64 over every slot: no slot-1 shortcut, no copy circuit,
    the shipped drafter's own layers and draft vocabulary, and an eval of at least 12 held-out prompts with the
    new drafter also served at K=16."""
    cfg = load_config("smollm2-135m")
    assert cfg.block_size == 64 and cfg.target.path == "asset:smollm2" and cfg.loss_positions is None
    assert cfg.drafter.init == "drafters/smollm2-135m-dflash" == cfg.eval.shipped and cfg.drafter.init_vocab
    assert cfg.draft_vocab == 8192 and cfg.drafter.num_layers == 4
    assert cfg.eval.num_prompts >= 12 and list(cfg.eval.also_blocks) == [16]
    with pytest.raises(ValueError, match=r"eval.also_blocks=\[128\]: 128 is not a block size in 2..64"):
        load_config("smollm2-135m", ["eval.also_blocks=[128]"])
    # The shipped drafter's recipe no longer inherits the main job's config: its first stage still starts from
    # the copy circuit and trains every slot.
    long = load_config("drafters/smollm2-135m-dflash/recipe/long.yml")
    assert long.drafter.init == "copy" and long.loss_positions is None and long.gamma == 5.0
    assert load_config("drafters/smollm2-135m-dflash/recipe/regen.yml").loss_positions is None


def test_grow_recipe_new_layers_are_the_fast_ones():
    """The grow recipe's new layers (null in drafter.init_layers) are exactly the ones train.lr_ratio speeds up."""
    from train.step import lr_ratio_of

    cfg = load_config("drafters/smollm2-135m-dflash/recipe/grow.yml")
    layers = list(cfg.drafter.init_layers)
    assert len(layers) == cfg.drafter.num_layers == len(cfg.drafter.layer_types)
    ratios = dict(cfg.train.lr_ratio)
    fast = [i for i in range(len(layers)) if lr_ratio_of(f"layers.{i}.self_attn.q_proj", ratios) > 1.0]
    assert fast == [i for i, src in enumerate(layers) if src is None] == [1, 3]
    assert lr_ratio_of("fc", ratios) == 1.0


def test_new_choices_are_checked():
    with pytest.raises(ValueError, match="train.compute_dtype='fp8'"):
        load_config("tiny", ["train.compute_dtype=fp8"])
    with pytest.raises(ValueError, match="data.labels='model'"):
        load_config("tiny", ["data.labels=model"])


def test_unknown_key_rejected_with_name_and_suggestion():
    with pytest.raises(ConfigKeyError, match=r"'train\.lrr'.*did you mean train\.lr"):
        load_config("tiny", ["train.lrr=1e-3"])
    with pytest.raises(ConfigKeyError, match="'blok_size'.*block_size"):
        load_config("tiny", ["blok_size=8"])


def test_override_typing():
    assert parse_value("6e-4") == 6e-4 and isinstance(parse_value("6e-4"), float)
    assert parse_value("3") == 3 and isinstance(parse_value("3"), int)
    assert parse_value("true") is True and parse_value("null") is None and parse_value("[0, 2]") == [0, 2]
    assert parse_value("runs/x") == "runs/x"
    cfg = load_config("tiny", ["train.lr=1e-3", "drafter.target_layer_ids=[1,3]", "gamma=null", "seed=7"])
    assert cfg.train.lr == 1e-3 and cfg.drafter.target_layer_ids == (1, 3) and cfg.seed == 7
    assert cfg.train.batch_size == 8  # siblings of an overridden key keep their preset values


def test_block_shortcut():
    name, ov = cli_overrides(["--config", "tiny", "--block", "64", "train.steps=5"])
    cfg = load_config(name, ov)
    assert name == "tiny" and cfg.block_size == 64 and cfg.train.steps == 5
    with pytest.raises(ValueError, match="unknown flag"):
        cli_overrides(["--blocks", "4"])


def test_free_form_arch_dict_accepts_target_fields():
    cfg = load_config("tiny", ["target.arch.num_hidden_layers=3"])
    assert cfg.target.arch["num_hidden_layers"] == 3 and cfg.target.arch["vocab_size"] == 512


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.steps=abc", r"train.steps='abc': expected int or null"),
        ("train.steps=0", r"train.steps=0: must be >= 1"),
        ("train.steps=-5", r"train.steps=-5: must be >= 1"),
        ("train.lr=-1", r"train.lr=-1: must be > 0"),
        ("train.lr=0", r"train.lr=0: must be > 0"),
        ("block_size=2.5", r"block_size=2.5: expected int"),
        ("train.batch_size=0", r"train.batch_size=0: must be >= 1"),
        ("num_anchors=0", r"num_anchors=0: must be >= 1"),
        ("checkpoint.every_steps=0", r"checkpoint.every_steps=0: must be >= 1"),
        ("block_size=100000", r"block_size=100000 exceeds train.max_len=64"),
        ("data.source=regenrate", r"data.source='regenrate': no such file.*did you mean regenerate"),
        ("drafter.n_features=3", r"target_layer_ids=\[0, 2\] has 2 layers but drafter.n_features=3"),
        ("log.tensorboard=maybe", r"log.tensorboard='maybe': expected bool"),
        ("train.warmup_ratio=1.5", r"train.warmup_ratio=1.5: must be <= 1.0"),
        ("distill_weight=-0.1", r"distill_weight=-0.1: must be >= 0"),
        ("data.source=null", r"data.source=null: give the data"),
        ("target.attention=flash", r"target.attention='flash': expected one of"),
        ("target.attention=cudnn", r"target.attention=cudnn needs target.dtype=bfloat16"),
    ],
)
def test_bad_values_are_refused_naming_the_key(override, message):
    """Each override is checked against its key's type in base.yml and a documented range before anything runs
    (these once trained garbage, crashed mid-run, or tried to allocate terabytes)."""
    with pytest.raises(ValueError, match=message):
        load_config("tiny", [override])


def test_flag_without_value_is_refused():
    for argv in (["--config"], ["--block"], ["--config", "--block", "8"]):
        with pytest.raises(ValueError, match="needs a value"):
            cli_overrides(argv)


def _with_blocks(tmp_path, blocks: str):
    """A preset over tiny.yml (block_size 8, num_anchors 6, batch 8) carrying a `blocks:` mapping."""
    path = tmp_path / "wide.yml"
    path.write_text(f"base: {REPO / 'configs' / 'tiny.yml'}\nblocks:\n{blocks}")
    return path


def test_block_preset_applies_at_its_k_only(tmp_path):
    path = _with_blocks(tmp_path, "  16:\n    num_anchors: 3\n    train: {batch_size: 4}\n")
    at_8, at_16 = load_config(path), load_config(path, ["block_size=16"])
    assert (at_8.block_size, at_8.num_anchors, at_8.train.batch_size) == (8, 6, 8)
    assert (at_16.block_size, at_16.num_anchors, at_16.train.batch_size) == (16, 3, 4)
    assert at_16.train.lr == at_8.train.lr  # siblings of a per-K key keep the preset's values
    # The command line beats the per-K value, whether it names the key or the entry.
    assert load_config(path, ["block_size=16", "num_anchors=5"]).num_anchors == 5
    by_entry = load_config(path, ["block_size=16", "blocks.16.num_anchors=7"])
    assert by_entry.num_anchors == 7 and by_entry.train.batch_size == 4 and list(by_entry.blocks) == [16]


@pytest.mark.parametrize(
    "blocks, error, message",
    [
        ("  16: {num_anchor: 3}\n", ConfigKeyError, r"'blocks\.16\.num_anchor'.*did you mean blocks\.16\.num_anchors"),
        ("  16: {train: {batch_siz: 3}}\n", ConfigKeyError, r"'blocks\.16\.train\.batch_siz'"),
        ("  16: {block_size: 32}\n", ConfigKeyError, r"'blocks\.16\.block_size'.*cannot set block_size"),
        ("  wide: {num_anchors: 3}\n", ValueError, r"blocks\.wide: a blocks key is a block size"),
        ("  16: 3\n", ValueError, r"blocks\.16=3: expected a mapping"),
        ("  16: {num_anchors: 0}\n", ValueError, r"blocks\.16: num_anchors=0: must be >= 1"),
        ("  128: {num_anchors: 3}\n", ValueError, r"blocks\.128: block_size=128 exceeds train\.max_len=64"),
    ],
)
def test_block_preset_is_checked_at_every_k(tmp_path, blocks, error, message):
    """A bad entry is refused, naming it, by a run at any K: the preset's own K=8 here."""
    with pytest.raises(error, match=message):
        load_config(_with_blocks(tmp_path, blocks))


@pytest.mark.parametrize("name", ["qwen3-8b", "llama-3.1-8b"])
def test_8b_recipes_ship_a_k128_preset(name):
    """`--block 128` of the 8B recipes trains 64 anchors (64 x 128 = 512 x 16 block positions); other K keep 512."""
    assert load_config(*cli_overrides(["--config", name, "--block", "128"])).num_anchors == 64
    assert load_config(*cli_overrides(["--config", name, "--block", "16"])).num_anchors == 512
    assert load_config(*cli_overrides(["--config", name, "--block", "128", "num_anchors=32"])).num_anchors == 32


def test_config_is_typed_frozen_and_round_trips():
    """The run config is a frozen dataclass tree: no setting changes after validate(); its YAML view (a run
    directory's config.yml) builds the same config again, `async` spelled as in base.yml."""
    import dataclasses

    import yaml

    from train.config import RunConfig

    cfg = load_config("smollm2-135m")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.lr = 1.0
    assert isinstance(cfg.eval.also_blocks, tuple) and cfg.checkpoint.asynchronous is True
    plain = yaml.safe_load(cfg.dump())
    assert plain["checkpoint"]["async"] is True and plain["eval"]["also_blocks"] == [16]
    assert RunConfig.from_dict(plain) == cfg
    # validate() holds the checks across keys: a config changed in code is refused as one read from YAML is.
    wide = dataclasses.replace(cfg, block_size=1024)
    with pytest.raises(ValueError, match=r"block_size=1024 exceeds train.max_len=384"):
        wide.validate()
    with pytest.raises(ValueError, match=r"train.lr=0.0: must be > 0.0"):
        dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=0.0)).validate()
