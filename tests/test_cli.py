"""`dflash generate`: JSON output and one-line errors with exit code 2 for user mistakes."""

import json

import pytest

from dflash.cli import main
from dflash.methods.dflash.drafter import DFlashConfig, DFlashDrafter


def run(capsys, *argv):
    code = main(["generate", "--target", "tiny-llama", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output(capsys):
    code, out, err = run(capsys, "--method", "ngram", "--max-new-tokens", "12", "--json", "w1 w2 w3")
    assert code == 0
    payload = json.loads(out)
    for key in ("text", "tokens", "tau", "tokens_per_s", "per_position_acceptance", "num_rounds"):
        assert key in payload
    assert len(payload["tokens"]) <= 12 and payload["tau"] >= 1


def test_json_logprobs_are_the_targets(capsys):
    import torch

    from dflash.testing import tiny_target

    code, out, err = run(capsys, "--method", "ngram", "--max-new-tokens", "6", "--json", "--logprobs", "2", "w1 w2")
    payload = json.loads(out)
    assert code == 0 and [e["token"] for e in payload["logprobs"]] == payload["tokens"]
    target = tiny_target("llama", logit_scale=4.0)  # the CLI's tiny-llama
    prompt_ids = target.encode_prompt("w1 w2")
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt_ids + payload["tokens"]])).logits[0, len(prompt_ids) - 1: -1]
    expected = torch.log_softmax(logits, -1)
    for position, entry in enumerate(payload["logprobs"]):
        assert entry["logprob"] == pytest.approx(expected[position, entry["token"]].item(), abs=1e-4)
        assert [t["token"] for t in entry["top"]] == expected[position].topk(2).indices.tolist()
        assert entry["text"] == target.decode([entry["token"]])


def test_ignore_eos_generates_past_the_end_of_sequence(capsys, monkeypatch):
    """--ignore-eos: generation goes on past the target's end-of-sequence token to --max-new-tokens. The tiny
    target's end-of-sequence is made the first token it generates for this prompt (which it then repeats)."""
    from dflash.models.target import TargetModel

    args = ["--method", "ar", "--max-new-tokens", "9", "--json", "--no-chat", "w5 w9"]
    free = json.loads(run(capsys, *args)[1])["tokens"]
    end = free[0]
    monkeypatch.setattr(TargetModel, "eos_token_ids", property(lambda self: [end]))
    stopped = json.loads(run(capsys, *args)[1])
    kept_on = json.loads(run(capsys, "--ignore-eos", *args)[1])
    assert stopped["finish_reason"] == "stop" and stopped["tokens"] == free[:1]  # the EOS token, then no more
    assert kept_on["finish_reason"] == "length" and kept_on["tokens"] == free


def test_stops_and_allowed_tokens_reach_the_engine(capsys):
    args = ["--method", "ngram", "--max-new-tokens", "12", "--json", "--no-chat", "w5 w9"]
    free = json.loads(run(capsys, *args)[1])
    word = free["text"].split()[3]
    cut = json.loads(run(capsys, "--stop", "w999", "--stop", word, *args)[1])
    kept = json.loads(run(capsys, "--stop", word, "--include-stop-str", *args)[1])
    assert cut["text"] == free["text"][: free["text"].index(word)] and cut["finish_reason"] == "stop"
    assert kept["text"] == free["text"][: free["text"].index(word) + len(word)]
    by_id = json.loads(run(capsys, "--stop-token-ids", str(free["tokens"][2]), *args)[1])
    assert by_id["tokens"] == free["tokens"][: free["tokens"].index(free["tokens"][2]) + 1]
    allowed = sorted(set(range(10, 30)) - set(free["tokens"]))
    held = json.loads(run(capsys, "--allowed-token-ids", ",".join(map(str, allowed)), *args)[1])
    assert held["tokens"] and set(held["tokens"]) <= set(allowed)
    barred = json.loads(run(capsys, "--bad-words", word, *args)[1])
    assert word not in barred["text"].split() and barred["tokens"] != free["tokens"]
    with pytest.raises(SystemExit):  # argparse's own one-line error
        run(capsys, "--allowed-token-ids", "5 7", *args)
    assert "token ids are integers separated by commas, got '5 7'" in capsys.readouterr().err


def test_penalties_reach_the_engine(capsys):
    from dflash.engine import GenerationConfig, SpeculativeDecoder
    from dflash.sampling import SamplingConfig
    from dflash.testing import tiny_target

    args = ["--method", "ngram", "--max-new-tokens", "12", "--json", "--no-chat", "w5 w9 w2 w33"]
    code, out, err = run(capsys, "--presence-penalty", "1.5", "--frequency-penalty", "0.5",
                         "--repetition-penalty", "1.8", *args)
    target = tiny_target("llama", logit_scale=4.0)  # the CLI's tiny-llama
    sampling = SamplingConfig(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.8)
    expected = SpeculativeDecoder(target).generate(target.encode_prompt("w5 w9 w2 w33", chat=False),
                                                   GenerationConfig(12, sampling))
    assert code == 0 and json.loads(out)["tokens"] == expected.tokens
    assert json.loads(run(capsys, *args)[1])["tokens"] != expected.tokens


def test_a_terminal_sees_the_text_as_it_comes(capsys, monkeypatch):
    """On a terminal the text is printed in pieces as rounds commit tokens, and adds up to the piped output."""
    import sys

    args = ["--method", "ngram", "--max-new-tokens", "16", "--no-chat", "w5 w9 w2 w33"]
    code, piped, _ = run(capsys, *args)
    pieces = []
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr("builtins.print", lambda *a, end="\n", **k: pieces.append("".join(map(str, a)) + end)
                        if k.get("file") is None else None)
    assert run(capsys, *args)[0] == 0
    assert len([p for p in pieces if p.strip()]) > 2 and "".join(pieces) == piped


def test_text_output_names_untrained_drafter(capsys):
    code, out, err = run(capsys, "--max-new-tokens", "8", "--block-size", "4", "w1 w2")
    assert code == 0 and "UNTRAINED" in err and "tau" in err


def test_compare_ar(capsys):
    """--compare-ar: the speedup line says the outputs are identical and reports medians of interleaved runs."""
    code, out, err = run(capsys, "--method", "ngram", "--max-new-tokens", "16", "--compare-ar", "w1 w2 w3 w1 w2")
    assert code == 0 and "outputs identical; median of 3 interleaved runs" in err
    code, out, err = run(capsys, "--method", "ngram", "--max-new-tokens", "16", "--compare-ar", "--json", "w1 w2")
    payload = json.loads(out)
    assert payload["speedup"] == pytest.approx(payload["tokens_per_s"] / payload["ar_tokens_per_s"])


def test_the_prompt_may_come_from_standard_input(capsys, monkeypatch):
    """`-` reads the prompt from standard input: the same tokens as the same text given as an argument."""
    import io

    code, given, _ = run(capsys, "--method", "ngram", "--max-new-tokens", "8", "--json", "w1 w2\nw3")
    monkeypatch.setattr("sys.stdin", io.StringIO("w1 w2\nw3"))
    code_piped, piped, _ = run(capsys, "--method", "ngram", "--max-new-tokens", "8", "--json", "-")
    assert code == code_piped == 0 and json.loads(piped)["tokens"] == json.loads(given)["tokens"]
    monkeypatch.setattr("sys.stdin", io.StringIO(" \n"))
    code, _, err = run(capsys, "-")
    assert code == 2 and "the prompt is empty" in err


@pytest.mark.parametrize("args, message", [
    (["   "], "empty"),
    (["--max-new-tokens", "0", "w1"], "max_new_tokens"),
    (["--temperature", "-0.5", "w1"], "temperature"),
    (["--temperature", "1", "--top-p", "1.5", "w1"], "top_p"),
    (["--top-p", "0", "w1"], "top_p"),
    (["w1 " * 600], "context"),
    (["--drafter", "/nonexistent/drafter", "w1"], "not found"),
    (["--logprobs", "2", "w1"], "--logprobs goes with --json"),
    (["--json", "--logprobs", "21", "w1"], "top logprobs"),
    (["--presence-penalty", "3", "w1"], "presence_penalty"),
    (["--temperature", "1", "--min-p", "2", "w1"], "min_p"),
    (["--max-new-tokens", "4", "--min-tokens", "5", "w1"], "min_tokens"),
    (["--include-stop-str", "w1"], "give --stop"),
    (["--stop-token-ids", "64", "w1"], "stop_token_ids must be token ids in [0, 64)"),
    (["--allowed-token-ids", "-1", "w1"], "allowed_token_ids"),
    (["--bad-words", " ", "w1"], "--bad-words takes non-empty words"),
    (["--method", "dflash", "--block-size", "64", "w1"], "block size"),
])
def test_bad_input_is_one_line_exit_2(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("dflash: error:")]
    assert "Traceback" not in err and len(errors) == 1 and message in errors[0]


@pytest.mark.parametrize("args, message", [
    (["--method", "dflash", "--block-size", "1", "w1"], "--block-size must be >= 2"),
    (["--method", "ngram", "--block-size", "65", "w1"], "--block-size must be <= 64"),
    (["--method", "dflash", "--tree", "0", "w1"], "a tree has 1 to 63"),
    (["--method", "eagle3", "--tree", "64", "w1"], "a tree has 1 to 63"),
    (["--drafter", "/nonexistent/drafter", "w1"], "dflash's drafter folder not found: /nonexistent/drafter"),
    (["--method", "eagle3+ngram", "--drafter", "/nonexistent/head", "w1"], "eagle3's drafter folder not found"),
    (["--drafter", "EMPTY", "w1"], "has no config.json or model.safetensors"),
])
def test_method_options_are_refused_before_the_target_loads(capsys, monkeypatch, tmp_path, args, message):
    import dflash.loading

    def no_loading(*_):
        raise AssertionError("the target loaded before the options were checked")

    monkeypatch.setattr(dflash.loading, "target_from_args", no_loading)
    args = [str(tmp_path) if arg == "EMPTY" else arg for arg in args]
    code, out, err = run(capsys, *args)
    assert code == 2 and message in err and "Traceback" not in err


def test_mismatched_drafter(capsys, tmp_path):
    from types import SimpleNamespace

    narrow = SimpleNamespace(num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                             hidden_size=32, intermediate_size=64, rms_norm_eps=1e-6, max_position_embeddings=512)
    DFlashDrafter(DFlashConfig.for_target(narrow, 64, 2, num_layers=1, block_size=4, num_features=2)).save(tmp_path)
    code, out, err = run(capsys, "--drafter", str(tmp_path), "w1")
    assert code == 2 and "hidden size" in err and "Traceback" not in err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--method", "beam", "w1"])
    assert exc.value.code == 2


def test_drafter_methods_come_with_prompt_lookup_and_share_their_drafter(capsys, tmp_path):
    """NAME+ngram for each method with a drafter: it loads NAME's drafter (--drafter NAME=PATH applies), reports
    its lookup rounds, and the CLI offers it."""
    from types import SimpleNamespace

    from dflash.options import drafter_paths, method_options
    from dflash.methods import registry

    assert {"dflash+ngram", "eagle3+ngram"} <= set(registry.names()) and "ngram+ngram" not in registry.names()
    assert registry.get("dflash+ngram").uses_drafter and registry.get("dflash+ngram").training is None
    assert drafter_paths(["dflash=/a"], ["ar", "dflash+ngram", "dflash"]) == {"dflash": "/a"}
    assert drafter_paths(["/b"], ["dflash+ngram"]) == {"dflash": "/b"}
    capsys.readouterr()
    # a drafter for a method that does not run is said to go unused (scripts pass one drafter to any methods)
    assert drafter_paths(["eagle3=/e"], ["ar", "dflash"]) == {"eagle3": "/e"}
    said = capsys.readouterr().err
    assert "--drafter eagle3=/e: no method here loads eagle3's drafter (ar, dflash); not used" in said
    drafter_paths(["eagle3+ngram=/e", "dflash=/a"], ["eagle3", "dflash+ngram"])
    assert "not used" not in capsys.readouterr().err
    args = SimpleNamespace(drafter=["dflash+ngram=/c"], block_size=None, draft_dtype="auto")
    assert method_options(args, "dflash").drafter == "/c" == method_options(args, "dflash+ngram").drafter
    code, out, err = run(capsys, "--method", "dflash+ngram", "--block-size", "4", "--max-new-tokens", "12", "--json",
                         "w1 w2 w3 w1 w2 w3 w1 w2")
    payload = json.loads(out)
    assert code == 0 and payload["method"] == "dflash+ngram" and "lookup_rounds" in payload


def test_an_unknown_target_says_what_it_was_tried_as(capsys, monkeypatch):
    """A name that is not in the registry, a folder or a .gguf file is tried as a hub id; offline that fails, and
    the one line says what the name was tried as and which registry names there are."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # hub_reachable reads it: the hub cache alone, no retries
    code = main(["generate", "--target", "no-such-model", "hi"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("dflash: error:")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1
    assert "no-such-model" in errors[0] and "hub id" in errors[0] and "smollm2-135m" in errors[0]


def test_an_unreachable_hub_fails_at_once_and_a_near_miss_is_named(capsys, monkeypatch):
    """Offline, a hub id is looked up in the local hub cache alone (transformers' own retries took ~30 s), and a
    name close to a registry name gets a "did you mean"."""
    import time

    import transformers

    from dflash.models import target as target_module

    asked = []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(target_module, "hub_reachable", lambda: False)
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(name, *args, **kwargs):
        asked.append(kwargs.get("local_files_only"))
        return real(name, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    start = time.perf_counter()
    code = main(["generate", "--target", "smollm2-135", "hi"])
    err = capsys.readouterr().err
    assert asked == [True] and time.perf_counter() - start < 10
    assert code == 2 and "Traceback" not in err and "did you mean smollm2-135m?" in err


def test_hub_reachable_asks_the_configured_endpoint(monkeypatch):
    import socket

    from dflash.hub import hub_reachable

    called = []

    def refuse(address, timeout):
        called.append(address)
        raise OSError("unreachable")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.example:8080")
    assert hub_reachable() is False and called == [("mirror.example", 8080)]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_reachable() is False and len(called) == 1  # offline mode: not even asked
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert hub_reachable() is True and len(called) == 1  # through a proxy: transformers' requests find out
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setattr(socket, "create_connection", lambda address, timeout: called.append(address) or socket.socket())
    monkeypatch.delenv("HF_ENDPOINT")
    assert hub_reachable() is True and called[-1] == ("huggingface.co", 443)


def test_a_command_settles_the_heap_after_loading(capsys, monkeypatch):
    """What loading left is collected, and what survived is frozen, before generating (loading.settle_heap):
    a full collection over a loaded model came due mid-generation and stalled it ~180 ms."""
    import gc

    from dflash import loading

    from dflash.models import native

    calls, targets = [], []
    real, load = loading.settle_heap, loading.target_from_args
    monkeypatch.setattr(loading, "settle_heap", lambda: (calls.append(gc.get_freeze_count()), real()))
    monkeypatch.setattr(loading, "target_from_args", lambda *a, **k: targets.append(load(*a, **k)) or targets[-1])
    code, out, _ = run(capsys, "--max-new-tokens", "4", "--json", "w1 w2")
    assert code == 0 and json.loads(out)["tokens"]
    assert calls == [0] and gc.get_freeze_count() > 0  # called once, after loading; the fixture unfreezes
    # the target's plain weights released as it loaded (tests/test_plain_weights.py), where our kernels run
    products = targets[0].engine.frozen_linears()[:-1]  # all but the LM head
    assert all(lin.released for lin in products) == (native.library() is not None)


def test_settle_heap_collects_cycles_and_freezes_survivors():
    import gc
    import weakref

    from dflash.loading import settle_heap

    class Node:
        pass

    garbage, kept = Node(), Node()
    garbage.self = garbage  # a cycle only the collector frees
    dead = weakref.ref(garbage)
    del garbage
    settle_heap()
    assert dead() is None
    assert gc.get_freeze_count() > 0 and not any(o is kept for o in gc.get_objects())  # frozen objects are not listed


def test_settle_heap_gives_freed_heap_back_to_the_system():
    """Memory freed inside the C heap (below mmap's threshold, so glibc keeps it) leaves the process's resident set
    at settle_heap (malloc_trim): it had held ~150-250 MB that loading SmolLM2 allocated and freed."""
    import ctypes
    import sys

    from dflash.loading import settle_heap

    libc = ctypes.CDLL(None)
    if not sys.platform.startswith("linux") or not hasattr(libc, "malloc_trim"):
        pytest.skip("malloc_trim is glibc's")

    def resident_mb() -> float:
        with open("/proc/self/status") as f:
            return int(f.read().split("VmRSS:")[1].split()[0]) / 1024

    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(32768) for _ in range(4096)]  # 128 MB in blocks the heap serves (mmap's threshold: 128 KB)
    assert all(blocks)
    for block in blocks:
        ctypes.memset(block, 1, 32768)
    for block in blocks[:-1]:  # the last one keeps the heap's top in use, so free() alone cannot shrink it
        libc.free(block)
    held = resident_mb()
    settle_heap()
    libc.free(blocks[-1])
    assert held - resident_mb() > 64


def test_env_says_what_runs_here_and_why_the_kernels_do_not(capsys, monkeypatch):
    import torch

    from dflash.models import native

    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"] == torch.__version__ and info["native_kernels"] == native.build_id()
    assert info["cpu_count"] >= 1 and isinstance(info["cpu"]["isa"], list)
    assert ("native_kernels_missing_because" in info) == (native.library() is None)
    monkeypatch.setattr(native, "library", lambda: None)
    monkeypatch.setattr(native, "why_not", "no C compiler")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "native_kernels_missing_because  no C compiler" in out and "\ntorch " in out


def test_vllms_speculative_config_is_our_method_drafter_and_block(capsys):
    """--speculative-config (vLLM's JSON): method ngram with 3 speculative tokens is --method ngram --block-size 4;
    keys vLLM's engine alone reads are reported as not used; beside --method, or malformed, a one-line error."""
    config = '{"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}'
    code, out, err = run(capsys, "--speculative-config", config, "--max-new-tokens", "8", "--json", "w1 w2")
    payload = json.loads(out)
    assert code == 0 and payload["method"] == "ngram" and len(payload["per_position_acceptance"]) == 3
    assert "draft_tensor_parallel_size not used" in err
    same = json.loads(run(capsys, "--method", "ngram", "--block-size", "4", "--max-new-tokens", "8", "--json",
                          "w1 w2")[1])
    assert same["tokens"] == payload["tokens"] and same["per_position_acceptance"] == payload["per_position_acceptance"]
    for args, message in [
            (["--speculative-config", config, "--method", "ar"], "not both"),
            (["--speculative-config", "{method: ngram}"], "not valid JSON"),
            (["--speculative-config", '{"method": "mtp"}'], "speculative_config method 'mtp'"),
            (["--speculative-config", '{"method": "ngram", "model": "x"}'], "ngram loads no drafter"),
            (["--speculative-config", '{"method": "dflash", "num_speculative_tokens": 0}'], "whole number >= 1"),
            (["--speculative-config", '{"method": "dflash", "model": "/nonexistent"}'], "folder not found"),
            (["--speculative-config", '{"method": "eagle3", "model": "org/head"}'], "looks like a hub id"),
            (["--speculative-config", '{"method": "dflash", "prompt_lookup_max": 3}'], "dflash does no prompt lookup"),
            (["--speculative-config", '{"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3}'],
             "prompt_lookup_min (3) must be at most prompt_lookup_max (2)")]:
        code, _, err = run(capsys, *args, "w1")
        assert code == 2 and "Traceback" not in err and message in err, (args, err)


def test_sglangs_and_vllms_flags_are_ours(capsys):
    """SGLang's launch flags (--model-path, --speculative-algorithm DFLASH|EAGLE3|NGRAM, --speculative-draft-model-path,
    --speculative-num-draft-tokens) and vLLM's --model are --target, --method, --drafter and --block-size."""
    ours = ["generate", "--target", "tiny-llama", "--method", "ngram", "--block-size", "4"]
    theirs = ["generate", "--model-path", "tiny-llama", "--speculative-algorithm", "NGRAM",
              "--speculative-num-draft-tokens", "4"]
    common = ["--max-new-tokens", "8", "--json", "w1 w2"]
    outputs = []
    for argv in (ours, theirs, [*theirs[:1], "--model", *theirs[2:]]):
        assert main([*argv, *common]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0]["method"] == outputs[1]["method"] == outputs[2]["method"] == "ngram"
    assert outputs[0]["tokens"] == outputs[1]["tokens"] == outputs[2]["tokens"]
    assert len(outputs[1]["per_position_acceptance"]) == 3
    assert main(["generate", "--target", "tiny-llama", "--speculative-draft-model-path", "/nonexistent", "w1"]) == 2
    assert "dflash's drafter folder not found: /nonexistent" in capsys.readouterr().err
