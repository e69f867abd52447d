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


# merges of the byte-level tokenizer (tiny_target(tokenizer="bytes")): tokens that span JSON's boundaries, as a
# real vocabulary's do (a closing quote with the colon after it, a space with an opening quote, whole literals)
BYTE_MERGES = [("{", '"'), ('"', ":"), ('"', ","), ("\u0120", '"'), ('"', "}"), ("}", "}"), ("]", ","), (":", "\u0120"),
               (",", "\u0120"), ("\u010a", "\u0120"), ("t", "r"), ("u", "e"), ("tr", "ue"), ("n", "u"), ("l", "l"),
               ("nu", "ll"), ("1", "2"), ("a", "b"), ("\u0120", "1"), ('\\', "n"), ("[", "{"), ("}", "]"), ("e", "-"),
               ("a", "m"), ("n", "am"), ("nam", "e"), ('"', "name"), ('"name', '":')]


def tiny_byte_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer (SmolLM2's kind): the specials, the 256 bytes, then BYTE_MERGES."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from .logprobs import byte_level_alphabet

    alphabet = sorted(byte_level_alphabet(), key=byte_level_alphabet().get)
    merged = ["".join(pair) for pair in BYTE_MERGES]
    words = SPECIAL_TOKENS + alphabet + merged
    if len(words) > vocab_size:
        raise ValueError(f"a byte-level tiny tokenizer needs vocab_size >= {len(words)}")
    core = Tokenizer(models.BPE({w: i for i, w in enumerate(words)}, BYTE_MERGES))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", mask_token="<mask>",
        additional_special_tokens=["<user>", "<assistant>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


# a chat template that writes tool calls as Qwen's do (`<tool_call>` tags around each call's JSON, tools.py's
# "hermes" format), describes the tools itself and shows results as a user turn; and thinks as Qwen3's does
# (reasoning.py): the reply may open <think> itself, `enable_thinking: false` closes it in the prompt, and
# `think_open: true` opens it there (as DeepSeek-R1's template does)
HERMES_TEMPLATE = (
    "{% if tools %}<user> tools:{% for t in tools %} {{ t.function.name }}{% endfor %} {% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}<assistant> {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}\n</tool_call>{% endfor %} {% elif m.role == 'tool' %}<user> <tool_response>{{ m.content }}"
    "</tool_response> {% else %}<user> {{ m.content }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% elif think_open %}<think>\n{% endif %}{% endif %}"
)


# a chat template that asks for calls as Llama 3's templates do (`{"name": ..., "parameters": {...}}`, tools.py's
# "llama3_json" format), lists the tools itself and shows a result as an `ipython` turn
LLAMA3_TEMPLATE = (
    "{% if tools %}<user> Call a function by answering in the format {\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}:{% for t in tools %} {{ t.function.name }}{% endfor %} {% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}<assistant> {{ m.content }}"
    "{% for c in m.tool_calls or [] %}{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}"
    "{% endfor %} {% elif m.role == 'tool' %}<user> ipython: {{ m.content }} {% else %}<user> {{ m.content }} "
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}"
)


def tiny_llama3_tokenizer(vocab_size: int):
    """tiny_byte_tokenizer with LLAMA3_TEMPLATE."""
    tok = tiny_byte_tokenizer(vocab_size)
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def tiny_hermes_tokenizer(vocab_size: int):
    """tiny_byte_tokenizer with `<tool_call>`, `</tool_call>`, `<think>` and `</think>` as tokens of their own (as
    Qwen3's are) and HERMES_TEMPLATE."""
    tok = tiny_byte_tokenizer(vocab_size - 4)
    tok.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>"])
    tok.chat_template = HERMES_TEMPLATE
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
                logit_scale: float = 1.0, hidden_size: int = 64, tokenizer: str = "words") -> TargetModel:
    """A random target (4 heads of hidden_size / 4). `logit_scale` sharpens the output distribution (random models
    are near uniform). `tokenizer`: "words" ("w0", "w1", ...), "bytes" (tiny_byte_tokenizer: JSON can be
    written; vocab_size >= 289), "hermes" (bytes, and a template that writes tool calls in tags) or "llama3" (bytes,
    and a template that asks for calls as Llama 3's do)."""
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
    words = {"bytes": tiny_byte_tokenizer, "hermes": tiny_hermes_tokenizer,
             "llama3": tiny_llama3_tokenizer}.get(tokenizer, tiny_tokenizer)(vocab_size)
    return TargetModel(model=model, tokenizer=words, name=f"tiny-{arch}", measure=False,
                       kernel_plan=NATIVE)
