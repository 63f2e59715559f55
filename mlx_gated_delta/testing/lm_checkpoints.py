"""Tiny random mlx-lm checkpoints written to a folder, with a tokenizer built
offline, so that mlx-lm's own commands (`mlx_lm generate`, `server`, `lora`)
load them as they load a downloaded model: `config.json`, the safetensors
weights and a Hugging Face fast tokenizer with a chat template.

The tokenizer is a word-level vocabulary of the model's size: the special
tokens, the chat roles and plain words `w0`, `w1`, ... split on whitespace,
so a prompt of those words encodes to known token ids and decodes back.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
ROLES = ("system", "user", "assistant")

# The chat template: one `<|im_start|>role text <|im_end|>` per message.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} "
    "{{ message['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def vocabulary(size: int) -> list[str]:
    """The tokens of a vocabulary of `size` entries, by id."""
    words = [f"w{i}" for i in range(size - len(SPECIAL_TOKENS) - len(ROLES))]
    return [*SPECIAL_TOKENS, *ROLES, *words]


def write_tokenizer(path: Path, size: int) -> None:
    """Saves a word-level fast tokenizer of `size` tokens to `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(vocabulary(size))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        bos_token=None,
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))


def save_checkpoint(model, path: Path) -> Path:
    """Writes an mlx-lm model (its `args` dataclass and weights) and a tokenizer
    of its vocabulary to `path`, in the layout `mlx_lm.utils.load` reads."""
    from mlx_lm.utils import save_config, save_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # Unset fields left out: transformers, which reads the config too, refuses a null.
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    config["eos_token_id"] = SPECIAL_TOKENS.index("<|im_end|>")
    save_model(path, model)
    save_config(config, config_path=path / "config.json")
    write_tokenizer(path, config["vocab_size"])
    return path


def write_lora_data(path: Path, size: int, examples: int = 16, seed: int = 0) -> Path:
    """Writes `train.jsonl` and `valid.jsonl` of `{"text": ...}` rows of words
    of the vocabulary to `path` (mlx-lm's LoRA data layout): each row counts
    up from a drawn word, a pattern a LoRA learns quickly."""
    import random

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    words = vocabulary(size)[len(SPECIAL_TOKENS) + len(ROLES) :]
    draw = random.Random(seed)
    for name, count in (("train", examples), ("valid", max(2, examples // 4))):
        with open(path / f"{name}.jsonl", "w") as out:
            for _ in range(count):
                start = draw.randrange(len(words) - 24)
                out.write(json.dumps({"text": " ".join(words[start : start + 24])}) + "\n")
    return path
