"""Write tests/fixtures/think_tokenizer/: a small byte-level BPE tokenizer (trained here on a few sentences) with
a ChatML chat template that, like Qwen3's in non-thinking mode, renders an empty think block in the last
assistant turn and in the generation prompt but not in earlier assistant turns. The template is written for
this fixture (not Qwen3's own text); it reproduces the one behaviour data.conversations must handle: past turns
rendered differently in the whole conversation than as the last message. Small enough to commit (~20 KB), so
the test that needs it runs in CI.

  .venv/bin/python tools/make_think_tokenizer.py
"""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "think_tokenizer"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# No whitespace control and no newline right after a tag: transformers renders with trim_blocks.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
CORPUS = [
    "hi",
    "Hello there.",
    "bye",
    "Goodbye.",
    "user",
    "assistant",
    "system",
    "How are you today?",
    "I am fine, thank you. What can I do for you?",
    "Write a function that adds two numbers.",
    "def add(a, b):\n    return a + b",
    "The answer is 42.",
]


def main() -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=TEMPLATE
    )
    fast.save_pretrained(OUT)
    print(f"wrote {OUT} ({sum(p.stat().st_size for p in OUT.iterdir())} bytes, vocabulary {len(fast)})")


if __name__ == "__main__":
    main()
