"""The CLIs' --target: 'smollm2' (the package-shipped SmolLM2-135M GGUF), an HF model directory or a .gguf file,
as a config and tokenizer first and its weights on demand."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from data.assets import target_file
from dflash_model.tokenizer import load_tokenizer
from dflash_model.weights import load_target, load_target_config


@dataclasses.dataclass
class Target:
    path: Path
    config: Any
    model: Any  # None until `load_weights` (load_target_spec(weights=False): the config and tokenizer only)
    tokenizer: Any  # None when the target directory ships none (then only --prompt-ids works)
    dtype: str | None = None

    def load_weights(self) -> Target:
        """Read the weights (a no-op once read): a CLI checks its inputs against the config first."""
        if self.model is None:
            self.config, self.model = load_target(self.path, dtype=self.dtype)
        return self


def load_target_spec(spec: str, dtype: str | None = None, *, weights: bool = True) -> Target:
    """'smollm2' or 'asset:smollm2' (the package-shipped SmolLM2-135M GGUF), an HF model directory or a .gguf file
    (`data.assets.target_file`, the trainer's reading too). weights=False:
    its config and tokenizer only (`Target.load_weights` reads the rest)."""
    path = target_file(spec)
    cfg = load_target_config(path, dtype=dtype)
    try:
        tok = load_tokenizer(path)
    except (FileNotFoundError, OSError, ValueError):
        tok = None
    target = Target(path, cfg, None, tok, dtype)
    return target.load_weights() if weights else target
