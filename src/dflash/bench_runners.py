"""The generations `dflash bench` times: one of our methods through the engine (`EngineRunner`), transformers' own
`generate` (`HFRunner`, the `hf` baseline), and llama.cpp in a process of its own on a GGUF file (`LlamaCppRunner`,
the `llamacpp` baseline), each returning a `Run` with its tokens, timings and rounds."""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import UserError

HF_METHOD = "hf"  # transformers' own generate, beside the engine's methods
# transformers' generate with its own speculative decoding, prompt lookup (`prompt_lookup_num_tokens`): what a
# transformers user gets for free, and the nearest thing to `ngram` there
HF_LOOKUP_METHOD = "hf-lookup"
HF_LOOKUP_TOKENS = 10  # drafts a round: transformers' documented example value
LLAMACPP_METHOD = "llamacpp"  # llama.cpp (llama-cpp-python) on a GGUF file: the engine a CPU user would pick instead
BASELINES = (HF_METHOD, HF_LOOKUP_METHOD, LLAMACPP_METHOD)  # other engines: timed, not ours to compare token by token
HF_METHODS = (HF_METHOD, HF_LOOKUP_METHOD)  # baselines that run transformers' forward (the plain weights)


@dataclass
class Run:
    tokens: list[int]
    text: str
    ttft_s: float
    total_s: float
    accept_lengths: list[int] | None = None  # None for hf (no verify rounds)
    draft_lengths: list[int] | None = None  # drafts verified per round
    skipped_drafting: int = 0
    lookup_rounds: int = 0  # rounds that verified prompt lookup's drafts (NAME+ngram)
    table_rounds: int = 0  # rounds that verified drafts of the target's continuation table
    prompt_ids: list[int] | None = None  # what the generation continued (a later turn: the conversation so far)


class EngineRunner:
    """A proposer behind the shared verification loop."""

    def __init__(self, method: str, target, proposer, sampling, adaptive: bool = True,
                 response_format: str | None = None, json_schema: dict | None = None):
        from .engine import SpeculativeDecoder

        self.method, self.sampling = method, sampling
        self.response_format, self.json_schema = response_format, json_schema  # structured output (structured.py)
        self.decoder = SpeculativeDecoder(target, proposer, adaptive=adaptive)
        self.block_size = proposer.max_draft + 1
        self.report = proposer.report

    @property
    def threads(self) -> dict | None:
        """Where this method's thread chooser ended up (threads.py); None when the count was fixed."""
        chooser = self.decoder.engine.threads
        if chooser is None:
            return None
        return {"counts": list(chooser.counts), "final": chooser.current, "probes": chooser.probes,
                "switches": chooser.switches}

    def generate(self, prompt_ids: list[int], max_new: int, ignore_eos: bool) -> Run:
        from .engine import GenerationConfig

        config = GenerationConfig(max_new_tokens=max_new, sampling=copy.copy(self.sampling), ignore_eos=ignore_eos,
                                  response_format=self.response_format, json_schema=self.json_schema)
        result = self.decoder.generate(prompt_ids, config)
        stats = result.stats
        return Run(result.tokens, result.text, stats.ttft_s, stats.total_s, list(stats.accept_lengths),
                   list(stats.draft_lengths), stats.skipped_drafting, stats.lookup_rounds, stats.table_rounds)


class _FirstTokenClock:
    """A `generate` streamer that notes when the first new token arrives (its first `put` is the prompt)."""

    def __init__(self):
        self.puts, self.first_token_at = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


class HFRunner:
    """The target's own `model.generate`, same prompt ids, same stop ids, same length limit as ar; with
    `lookup_tokens`, transformers' prompt lookup decoding drafting that many tokens a round (hf-lookup)."""

    block_size = 1

    def __init__(self, target, sampling, lookup_tokens: int | None = None):
        from transformers.generation.streamers import BaseStreamer

        self.target, self.sampling, self.lookup_tokens = target, sampling, lookup_tokens
        self.method = HF_LOOKUP_METHOD if lookup_tokens else HF_METHOD
        target.restore_plain_weights()  # transformers' forward reads the model's own parameters
        self.clock_type = type("FirstTokenClock", (_FirstTokenClock, BaseStreamer), {})

    def generation_config(self, max_new: int, ignore_eos: bool):
        gc = copy.deepcopy(self.target.model.generation_config)
        eos = self.target.eos_token_ids
        gc.max_new_tokens, gc.max_length, gc.min_new_tokens, gc.min_length = max_new, None, None, 0
        gc.eos_token_id = None if ignore_eos else (eos or None)
        gc.pad_token_id = eos[0] if eos else 0
        gc.do_sample = not self.sampling.greedy
        if gc.do_sample:
            gc.temperature, gc.top_k, gc.top_p = self.sampling.temperature, self.sampling.top_k, self.sampling.top_p
        else:  # unset sampling knobs so transformers does not warn that they are ignored
            gc.temperature = gc.top_k = gc.top_p = None
        gc.prompt_lookup_num_tokens = self.lookup_tokens
        return gc

    def generate(self, prompt_ids: list[int], max_new: int, ignore_eos: bool) -> Run:
        target = self.target
        max_new = min(max_new, target.max_context - len(prompt_ids) - 1)  # the ar engine's own limit
        input_ids = torch.tensor([prompt_ids], device=target.device)
        clock = self.clock_type()
        if self.sampling.seed is not None:
            torch.manual_seed(self.sampling.seed)
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                generation_config=self.generation_config(max_new, ignore_eos), streamer=clock,
            )
        tokens = out[0, len(prompt_ids):].tolist()  # the host copy also waits for the device
        total = time.perf_counter() - start
        eos = set(target.eos_token_ids)
        shown = tokens[:-1] if tokens and tokens[-1] in eos and not ignore_eos else tokens
        ttft = (clock.first_token_at or time.perf_counter()) - start
        return Run(tokens, target.decode(shown), ttft, total)


class BaselineCrashed(Exception):
    """A baseline's engine died in its own process (bench drops the method and goes on with the others)."""


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python (the optional extra `dflash[llamacpp]`) on a GGUF file of the target:
    greedy (or sampled) decoding of the same prompt ids, timed the same way. By default the GGUF file the registry
    ships (for smollm2-135m: Q4_1-quantised, so its outputs differ from the float32 target's and are not compared).
    llama.cpp runs in a process of its own (llamacpp_worker.py), which times each generation itself, so that a crash
    in its native code ends that process and this runner (BaselineCrashed), not the benchmark."""

    method, block_size = LLAMACPP_METHOD, 1

    def __init__(self, target, gguf: str | None, sampling):
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            raise UserError("the llamacpp baseline needs llama-cpp-python: pip install 'dflash[llamacpp]' "
                            "(it compiles llama.cpp: 5-20 minutes on 2 cores)")
        path = (converted_gguf(registry_gguf(target.name), gguf) if gguf in CONVERSIONS
                else Path(gguf) if gguf else registry_gguf(target.name))
        if not path.is_file():
            raise UserError(f"GGUF file not found: {path}")
        self.path, self.sampling, self.eos = path, sampling, sorted(set(target.eos_token_ids))
        self.quantization = quantization_of(path)
        self.decode = target.decode
        worker = Path(__file__).with_name("llamacpp_worker.py")
        self.process = subprocess.Popen(
            [sys.executable, str(worker), str(path), str(min(target.max_context, 4096)), str(torch.get_num_threads()),
             str(sampling.seed or 0)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        ready = self._reply()
        if "error" in ready:
            self.close()
            raise UserError(f"llama.cpp could not load {path}: {ready['error']}")

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:  # the worker is gone: say how it ended
            code = self.process.wait()
            how = f"signal {signal_name(-code)}" if code < 0 else f"exit status {code}"
            hint = ("; SIGILL: an instruction this CPU or OS refused (a llama-cpp-python built with GGML_NATIVE died "
                    "so in its AMX path on an Intel Xeon; built with -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF "
                    "-DGGML_AMX_BF16=OFF it ran: docs/RESULTS.md, forty-ninth session)"
                    if code == -signal.SIGILL else "")
            raise BaselineCrashed(f"llama.cpp's process died ({how}) running {self.path.name}{hint}")
        return json.loads(line)

    def generate(self, prompt_ids: list[int], max_new: int, ignore_eos: bool) -> Run:
        request = {"prompt": list(prompt_ids), "max_new": max_new, "eos": self.eos, "ignore_eos": ignore_eos,
                   "temperature": self.sampling.temperature, "top_p": self.sampling.top_p}
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # (died before: _reply says how)
        reply = self._reply()
        tokens = reply["tokens"]
        shown = tokens[:-1] if tokens and tokens[-1] in self.eos and not ignore_eos else tokens
        return Run(tokens, self.decode(shown), reply["ttft"], reply["total"])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


CONVERSIONS = {"f32": ("F32", "LLAMA_FTYPE_ALL_F32"), "bf16": ("BF16", "LLAMA_FTYPE_MOSTLY_BF16"),
               "q8_0": ("Q8_0", "LLAMA_FTYPE_MOSTLY_Q8_0")}


def converted_gguf(source: Path, kind: str = "f32") -> Path:
    """An F32, BF16 or Q8_0 copy (`kind` f32 / bf16 / q8_0) of a GGUF file, made once by llama.cpp's own converter
    beside the original. The registry's SmolLM2 file is Q4_1 and the float32 target is that file dequantised, so the
    F32 copy holds the very weights the target runs, and the BF16 copy those of the bfloat16 target (the same
    weights rounded to bfloat16): llama.cpp and dflash then do the same arithmetic on the same numbers. Q8_0 is
    llama.cpp's int8 (a scale per 32 weights), beside an int8 target (a scale per row): alike in bytes, not in
    numbers."""
    import ctypes

    import llama_cpp

    suffix, ftype = CONVERSIONS[kind]
    out = source.with_name(f"{source.stem}.{suffix}.gguf")
    if out.is_file():
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = getattr(llama_cpp, ftype), True, 0
    partial = out.with_name(out.name + ".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
        raise UserError(f"llama.cpp could not convert {source} to {suffix}")
    partial.replace(out)
    return out


def registry_gguf(name: str) -> Path:
    from .hub import REGISTRY, fetch_gguf

    if name not in REGISTRY:
        raise UserError(f"--llamacpp-gguf is needed for target {name!r} (only registry targets ship a GGUF file)")
    return fetch_gguf(name)


def quantization_of(path: Path) -> str:
    """The GGUF file's weight type as its name says it (e.g. Q4_1, F32, BF16), else "unknown"."""
    import re

    # the last one named: a converted copy ("model.Q4_1.F32.gguf") is what its last suffix says
    found = re.findall(r"(BF16|F16|F32|Q\d_K(?:_[SML])?|Q\d_\d|Q\d_0|IQ\d\w*)", path.name, re.IGNORECASE)
    return found[-1].upper() if found else "unknown"
