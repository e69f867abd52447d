"""The paths a real target takes and the tiny test targets skip: a target that measures (a model wrapped by
wrap_target, as a loaded one is) times its kernels, its drafters' precisions and their kernels on this machine, and
runs what those timings chose. Every method, drafting precision and tree still gives the plain greedy tokens, in
float32, bfloat16 and int8. (A head shaped as a layer product once sent that product to the int8 head's kernel here.)"""

import itertools

import pytest
import torch

from dflash import LLM, GenerationConfig, SpeculativeDecoder, wrap_target
from dflash.testing import tiny_target

PROMPTS = ["w1 w2 w3", "w6 w1 w6 w1"]


def measured_target(arch: str, dtype: str):
    loaded = tiny_target(arch, logit_scale=4.0)
    model = loaded.model.to(torch.bfloat16 if dtype in ("bfloat16", "int8") else torch.float32)
    return wrap_target(model, loaded.tokenizer, name=f"measured-{arch}", int8=dtype == "int8")


@pytest.mark.parametrize("arch, dtype", [("llama", "float32"), ("qwen3", "float32"), ("gemma3", "float32"),
                                         ("qwen2", "bfloat16"), ("gemma3", "int8")])
def test_every_measured_choice_gives_the_plain_greedy_tokens(arch, dtype):
    reference = measured_target(arch, dtype)
    assert reference.measure
    plain = [SpeculativeDecoder(reference).generate(reference.encode_prompt(p), GenerationConfig(16)).tokens
             for p in PROMPTS]
    for method, draft_dtype, tree in itertools.product(["dflash+ngram", "eagle3+ngram"],
                                                       ["auto", "bfloat16", "int8", "int8-head"], [None, 5]):
        llm = LLM(measured_target(arch, dtype), method, device="cpu", draft_dtype=draft_dtype, tree=tree,
                  max_batch=2)
        got = [result.tokens for result in llm.generate(PROMPTS, max_new_tokens=16)]
        assert got == plain, (method, draft_dtype, tree)
