"""The `dflash` command: generate, batch, chat, data, train, bench, serve, fetch, env.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int` (generate.py,
batch.py, chat.py, data.py, trainer.py, bench.py, serving/app.py, hub.py, environment.py); this file wires them
up. The argument groups they share are in options.py, so the same thing has the same flag everywhere.

User mistakes (UserError) print one line and exit with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from . import options, threads
from .errors import UserError

SUBCOMMANDS = {
    "generate": ("dflash.generate", "speculative generation of one prompt"),
    "batch": ("dflash.batch", "many prompts from a JSONL file as one continuous batch, answers to a JSONL file"),
    "chat": ("dflash.chat", "a conversation in the terminal, each reply printed as it is generated"),
    "data": ("dflash.data", "build a prompt mix and regenerate responses with the target"),
    "train": ("dflash.trainer", "train a DFlash (or EAGLE-3) drafter"),
    "bench": ("dflash.bench", "benchmark methods side by side (tau, speedup, tokens/s)"),
    "serve": ("dflash.serving.app", "OpenAI-compatible HTTP server (and Anthropic's Messages API)"),
    "fetch": ("dflash.hub", "download and convert registry target models into the cache"),
    "env": ("dflash.environment", "what this machine and install give dflash (for bug reports)"),
}


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own exit code is already 2; keep it to one line
        self.exit(2, f"dflash: error: {message}\n")


# ---- entry point ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's parser. A subcommand whose module fails to import is an error, never silently absent."""
    parser = ArgumentParser(prog="dflash", description="Lossless block-diffusion speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        options.apply_speculative_config(args)  # vLLM's flag, as our own flags (generate, batch, chat, serve)
        if getattr(args, "threads", None) is not None:
            if args.threads < 1:
                raise UserError(f"--threads must be >= 1, got {args.threads}")
            import torch

            torch.set_num_threads(args.threads)
            threads.pin()  # without --threads the engine times its passes on n and n - 1 threads (threads.py)
        return args.handler(args) or 0
    except UserError as exc:
        print(f"dflash: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dflash: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
