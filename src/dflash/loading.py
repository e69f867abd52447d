"""From user-facing names to ready objects: targets (incl. tiny random ones) and proposers by method name.

This module sits above every method: it looks methods up in the registry and never names one.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from .errors import UserError
from .methods import registry
from .methods.base import MethodOptions, Proposer
from .models import memory
from .models.target import TARGET_DTYPES, TargetModel, choose_kernels, compile_target, load_target, quantize_int8

TINY_ARCHS = ("llama", "qwen3", "gemma3", "qwen2")


def load_target_cached(spec: str, dtype: str = "float32", device: str = "cpu", kernels: str = "auto",
                       compile: bool = False, cuda_graphs: bool | None = None,
                       release_plain: bool = False) -> TargetModel:
    """`tiny-llama` / `tiny-qwen3` / `tiny-gemma3` / `tiny-qwen2` give tiny random targets (our native kernels where
    they build, nothing measured; `tiny-ARCH-bytes`: with a byte-level tokenizer, which can write JSON;
    `tiny-ARCH-hermes`: that, and a chat template that writes tool calls in <tool_call> tags; `tiny-ARCH-llama3`: one
    that asks for Llama 3's calls); anything
    else goes to load_target. `cuda_graphs` None: on where they can run
    (graphs_by_default)."""
    if spec.startswith("tiny-"):
        from .testing import tiny_target

        arch, _, kind = spec.removeprefix("tiny-").partition("-")
        if arch not in TINY_ARCHS or kind not in ("", "bytes", "hermes", "llama3"):
            raise UserError(f"unknown tiny target {spec!r}; use {', '.join('tiny-' + a for a in TINY_ARCHS)}")
        if dtype not in TARGET_DTYPES:
            raise UserError(f"unknown dtype {dtype!r}; choose one of {', '.join(TARGET_DTYPES)}")
        target = tiny_target(arch, vocab_size=320 if kind else 64, logit_scale=4.0, tokenizer=kind or "words")
        target.measure, target.release_plain = False, release_plain
        target.model.to(TARGET_DTYPES[dtype])
        if dtype == "int8":
            quantize_int8(target)
        choose_kernels(target, "native" if kernels == "auto" else kernels)
    else:
        target = load_target(spec, dtype, device, kernels, release_plain)
    graphs = cuda_graphs if cuda_graphs is not None else graphs_by_default(target)
    if graphs:  # --compile then fuses the graphed passes' layers, which the graphs capture
        target.use_graphs()
        if compile:
            target.compile_graphs()
    elif compile:
        compile_target(target)
    return target


def graphs_by_default(target: TargetModel) -> bool:
    """CUDA graphs unless asked otherwise: on a CUDA target through our forward (not transformers'), where they
    measured faster. On an H100 (docs/RESULTS.md, twenty-seventh session) `ar` took 2.8 ms a token in graphs and
    38.6 ms eagerly, where every one of a step's ~450 small kernels pays its launch."""
    return target.device.type == "cuda" and target.backend == "dflash"


def target_from_args(args, many_rows: bool = False, release_plain: bool = False) -> TargetModel:
    """The target the CLI's target arguments (options.add_target_arguments) describe. `many_rows`: a command whose
    passes batch a changing number of rows (serving, regeneration, training) runs graphs only when asked: graphs
    are kept per row count (padded to powers of two) and width, and how such a load fares is not yet measured.
    `release_plain`: a command that runs no forward of transformers' (TargetModel.release_plain)."""
    graphs = getattr(args, "cuda_graphs", None)
    template = chat_template_given(getattr(args, "chat_template", None))  # checked before the target loads
    target = load_target_cached(args.target, args.dtype, args.device, args.kernels, args.compile,
                                False if graphs is None and many_rows else graphs, release_plain)
    if template is not None:
        target.tokenizer.chat_template = template
    return target


def chat_template_given(given: str | None) -> str | None:
    """--chat-template: a file holding a Jinja chat template, or the template itself; UserError where it does not
    parse."""
    if given is None:
        return None
    from jinja2 import Environment, TemplateSyntaxError

    path = Path(given)
    looks_like_text = "{%" in given or "{{" in given
    if not looks_like_text and not path.is_file():
        raise UserError(f"--chat-template: no such file {given!r} (give a Jinja template's file, or the template)")
    text = given if looks_like_text else path.read_text()
    try:
        Environment().parse(text)
    except TemplateSyntaxError as error:
        raise UserError(f"--chat-template does not parse as Jinja: {error.message} (line {error.lineno})") from None
    return text


def build_proposer(method: str, target: TargetModel, options: MethodOptions | None = None
                   ) -> tuple[Proposer, str | None]:
    """A proposer by method name, with a note for the user when it runs on an untrained drafter."""
    options = options or MethodOptions()
    chosen = registry.get(method)
    if options.drafter is not None and not chosen.uses_drafter:
        raise UserError(f"--drafter does not apply to --method {method}")
    return chosen.build_proposer(target, options)


def settle_heap() -> None:
    """Collect what loading left behind, then exempt what survived (the model, its tokenizer, the modules of torch
    and transformers: ~380,000 objects with SmolLM2) from the garbage collector's later passes. Loading allocates
    enough that a full pass comes due soon after, and a full pass over those objects took 170-220 ms: in the first
    generations after loading SmolLM2 (`dflash+ngram`, float32) one ran, 173-215 ms in the middle of a generation,
    in each of three runs, and none after this call (scripts/gc_after_loading.py; docs/RESULTS.md, thirtieth
    session). For processes that load once and then generate (the CLI's commands, the server); what a process
    creates later is collected as usual. Then the heap that loading freed goes back to the system."""
    gc.collect()
    gc.freeze()
    memory.return_freed_heap()


def default_threads() -> int:
    return torch.get_num_threads()
