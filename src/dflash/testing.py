"""Tiny random targets of each supported architecture, for tests and for trying the stack without a download.

`tiny_target("llama")` builds a 4-layer model with a word-level tokenizer of `vocab_size` words ("w0", "w1", ...),
so tests can run the whole engine, trainer and server in seconds.
"""

from __future__ import annotations

import torch

from .models.kernels import NATIVE
from .models.target import TargetModel

SPECIAL_TOKENS = ["<pad>", "<eos>", "<mask>", "<user>", "<assistant>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<user> ' if m['role'] == 'user' else '<assistant> ' }}{{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}"
)


def tiny_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL_TOKENS + [f"w{i}" for i in range(vocab_size - len(SPECIAL_TOKENS))]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", mask_token="<mask>",
        additional_special_tokens=["<user>", "<assistant>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_config(arch: str, vocab_size: int = 64, num_layers: int = 4, hidden_size: int = 64):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
        max_position_embeddings=512, eos_token_id=1, pad_token_id=0, bos_token_id=None,
    )
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return Qwen3Config(**common, tie_word_embeddings=False)
    if arch == "qwen2":  # biases on q/k/v, none on o
        return Qwen2Config(**common, tie_word_embeddings=False)
    if arch == "gemma3":
        # a small sliding window so the rollback of sliding-window layers is exercised
        return Gemma3TextConfig(**common, sliding_window=16, query_pre_attn_scalar=hidden_size // 4)
    raise ValueError(f"unknown tiny architecture {arch!r}")


def tiny_target(arch: str = "llama", vocab_size: int = 64, num_layers: int = 4, seed: int = 0,
                logit_scale: float = 1.0, hidden_size: int = 64) -> TargetModel:
    """A random target (4 heads of hidden_size / 4). `logit_scale` sharpens the output distribution (random models
    are near uniform)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, vocab_size, num_layers, hidden_size),
                                             dtype=torch.float32)
    if logit_scale != 1.0:
        with torch.no_grad():
            head = model.get_output_embeddings()
            if model.config.tie_word_embeddings:
                model.model.norm.weight.mul_(logit_scale)
            else:
                head.weight.mul_(logit_scale)
    model.eval()
    # nothing timed: a test's costs come from its injected clock, never from this machine's speed. Our own kernels
    # (the one-token layer step and products, native.py) where this machine builds them, so every test runs
    # through them as a real model does; torch's F.linear where it does not.
    return TargetModel(model=model, tokenizer=tiny_tokenizer(vocab_size), name=f"tiny-{arch}", measure=False,
                       kernel_plan=NATIVE)
