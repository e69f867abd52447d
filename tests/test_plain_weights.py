"""Released plain weights (FrozenLinear.release_plain, TargetModel.release_plain_weights): a CPU target whose decoder
products run our kernels alone drops the plain copy of their weights. Passes and generations stay bitwise the same,
the memory is freed, whatever reads the weight later gets it back bitwise, and transformers' forward fails with a
message rather than reading a stand-in."""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import TINY_ARCHS, load_target_cached
from dflash.methods.ngram import NgramProposer
from dflash.models import native
from dflash.models.kernels import PLAIN, ReleasedWeight
from dflash.models.target import own_storage

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C kernels here: nothing is released")

PROMPT = [5, 9, 12, 7, 3, 9, 12, 7]


def products(target):
    return [lin for layer in target.engine.layers for lin in target.engine._products(layer)]


def passes(target) -> list[torch.Tensor]:
    """A prompt pass's logits and four greedy steps' (the C stack's 1-row and many-row paths)."""
    cache = target.new_cache()
    with torch.inference_mode():
        out = [target.forward(torch.tensor([PROMPT]), cache).logits]
        for _ in range(4):
            out.append(target.forward(out[-1][:, -1:].argmax(-1), cache).logits)
    return out


def generation(target) -> list[int]:
    decoder = SpeculativeDecoder(target, NgramProposer(max_draft=4), adaptive=False)
    return decoder.generate(PROMPT, GenerationConfig(max_new_tokens=24, ignore_eos=True)).tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_passes_are_bitwise_the_same_and_the_weights_come_back_bitwise(arch, dtype):
    target = load_target_cached(f"tiny-{arch}", dtype=dtype)
    weights = [lin.weight.clone() for lin in products(target)]
    params = {name: p.detach().clone() for name, p in target.model.named_parameters()}
    before, tokens = passes(target), generation(target)
    with torch.inference_mode():
        theirs = target.model(torch.tensor([PROMPT])).logits

    released = target.release_plain_weights()
    integers = dtype == "int8" and native.int8_kernel() == "widened"  # that layout holds them: they go too
    assert released == sum(w.numel() * (w.element_size() + integers) for w in weights) > 0
    assert all(lin.released for lin in products(target))
    assert all(torch.equal(a, b) for a, b in zip(passes(target), before))
    assert generation(target) == tokens
    with pytest.raises(RuntimeError, match="restore_plain_weights"):
        target.model(torch.tensor([PROMPT]))

    target.restore_plain_weights()
    assert not any(lin.released for lin in products(target))
    assert all(torch.equal(lin.weight, w) for lin, w in zip(products(target), weights))
    restored = dict(target.model.named_parameters())
    assert all(type(restored[name].data) is torch.Tensor and torch.equal(restored[name], p)
               for name, p in params.items())
    with torch.inference_mode():
        assert torch.equal(target.model(torch.tensor([PROMPT])).logits, theirs)
    assert all(torch.equal(a, b) for a, b in zip(passes(target), before))


def test_a_released_weight_is_freed():
    target = load_target_cached("tiny-llama")
    passes(target)  # the C stack's arguments made (they hold the products they checked)
    gone = [weakref.ref(lin.weight) for lin in products(target)]
    target.release_plain_weights()
    gc.collect()
    assert all(ref() is None for ref in gone)


def test_what_reads_a_released_weight_makes_it_again():
    target = load_target_cached("tiny-qwen2")  # q, k and v with biases
    lin = products(target)[0]
    weight = lin.weight.clone()
    x = torch.randn(3, weight.shape[1])
    target.release_plain_weights()
    assert torch.equal(lin.run(x, "plain"), F.linear(x, weight, lin.bias))  # torch's kernel: the weight, made again
    assert not lin.released and products(target)[1].released  # only that one

    target.release_plain_weights()
    lin.use_plan(PLAIN)  # a plan that picks another kernel for some rows
    assert torch.equal(lin(x), F.linear(x, weight, lin.bias))
    assert not lin.released


def test_weights_loaded_after_a_release_run_as_loaded():
    target, fresh = load_target_cached("tiny-llama"), load_target_cached("tiny-llama")
    state = {name: value * 1.5 for name, value in target.model.state_dict().items()}
    target.release_plain_weights()
    target.model.load_state_dict(state)
    fresh.model.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(passes(target), passes(fresh)))


def test_a_released_model_cannot_be_moved_or_cast_unnoticed():
    target = load_target_cached("tiny-llama")
    target.release_plain_weights()
    with pytest.raises(RuntimeError, match="restore_plain_weights"):
        target.model.to(torch.float64)


def test_nothing_is_released_where_torch_kernels_run():
    target = load_target_cached("tiny-llama", kernels="plain")
    assert target.release_plain_weights() == 0
    assert not any(lin.released for lin in products(target))


def test_weights_in_memory_torch_did_not_allocate_get_their_own():
    """A safetensors file loaded in its own dtype is views into its mapping: copied out, the mapping can close."""
    model = torch.nn.Linear(4, 3)
    outside = bytearray(torch.arange(12, dtype=torch.float32).numpy().tobytes())
    with torch.no_grad():
        model.weight.data = torch.frombuffer(outside, dtype=torch.float32).view(3, 4)
    assert not model.weight.untyped_storage().resizable()
    own_storage(model)
    assert model.weight.untyped_storage().resizable()
    assert torch.equal(model.weight, torch.arange(12, dtype=torch.float32).view(3, 4))


def test_an_int8_target_whose_kernels_switch_after_a_release_runs_as_before():
    """The widened layout's release drops the integers too: tiles made again (here: the int8 kernels switched off
    and on, as A/B runs do) read them back from the released tiles."""
    target = load_target_cached("tiny-llama", dtype="int8")
    before = passes(target)
    target.release_plain_weights()
    old = native.set_int8_kernels(False)  # bfloat16 tiles of the weight the integers stand for: made again
    try:
        passes(target)
    finally:
        native.set_int8_kernels(old)
    assert all(torch.equal(a, b) for a, b in zip(passes(target), before))
    target.release_plain_weights()
    assert all(torch.equal(a, b) for a, b in zip(passes(target), before))


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_target_loaded_to_release_runs_as_one_that_keeps_them(dtype):
    """release_plain=True (the CLI's commands): each product's plain weight goes as its tiles are laid out."""
    released, kept = (load_target_cached("tiny-qwen3", dtype=dtype, release_plain=r) for r in (True, False))
    assert all(lin.released for lin in products(released)) and not any(lin.released for lin in products(kept))
    assert all(torch.equal(a, b) for a, b in zip(passes(released), passes(kept)))
    assert generation(released) == generation(kept)


def test_a_target_loaded_from_a_safetensors_folder_owns_its_memory(tmp_path):
    """transformers loads a float32 safetensors file as views into its mapping; load_target copies them out
    (own_storage), so no tensor keeps the mapping, and the target runs as the one it was saved from."""
    from transformers import AutoModelForCausalLM

    from dflash.models.target import choose_kernels, load_target
    from dflash.testing import tiny_target

    saved = tiny_target("qwen3", logit_scale=4.0)
    saved.model.save_pretrained(tmp_path)
    saved.tokenizer.save_pretrained(tmp_path)
    mapped = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert not all(p.untyped_storage().resizable() for p in mapped.parameters())  # the case this is about

    target = load_target(str(tmp_path), kernels="native", release_plain=True)
    assert all(lin.released for lin in products(target))
    tensors = [*target.model.parameters(), *target.model.buffers(), *target.engine.buffers()]
    held = [t for t in tensors if not isinstance(t, ReleasedWeight)]
    assert len(held) < len(tensors) and all(t.untyped_storage().resizable() for t in held)
    choose_kernels(saved, "native")
    assert all(torch.equal(a, b) for a, b in zip(passes(target), passes(saved)))
