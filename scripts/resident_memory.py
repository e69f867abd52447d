"""Resident memory after loading a target and a method's drafter as `dflash generate` loads them (MB, /proc/self).

Usage: .venv/bin/python scripts/resident_memory.py [kept|released] [float32|bfloat16|int8] [METHOD]

  kept: as before the forty-third session: the plain weights kept beside our tiles, parameters left in the
  safetensors file's mapping (`own_storage` skipped);
  released: as the CLI loads now (own_storage; each plain weight released as its tiles are laid out).
Prints the resident set (VmRSS) with its anonymous and file-backed parts (/proc/self/smaps), and a hash of the
tokens of a 32-token greedy generation, which must be the same in both modes.
"""

import re
import sys

from dflash.models import target as target_module


def resident_mb() -> tuple[int, int, int]:
    parts = {"anon": 0, "file": 0}
    mapping = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                fields = line.split()
                mapping = fields[5] if len(fields) > 5 else "[anon]"
            elif line.startswith("Rss:"):
                parts["file" if mapping.startswith("/") else "anon"] += int(line.split()[1])
    with open("/proc/self/status") as status:
        rss = int(re.search(r"VmRSS:\s+(\d+)", status.read()).group(1))
    return rss >> 10, parts["anon"] >> 10, parts["file"] >> 10


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "released"
    dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
    method = sys.argv[3] if len(sys.argv) > 3 else "dflash+ngram"
    if mode not in ("kept", "released"):
        sys.exit(__doc__)
    if mode == "kept":
        target_module.own_storage = lambda model: None
    from dflash.engine import GenerationConfig, SpeculativeDecoder
    from dflash.loading import build_proposer, load_target_cached, settle_heap
    from dflash.methods.base import MethodOptions

    target = load_target_cached("smollm2-135m", dtype=dtype, release_plain=mode == "released")
    proposer, _ = build_proposer(method, target, MethodOptions(draft_dtype="auto"))
    settle_heap()
    rss, anon, file_backed = resident_mb()
    prompt = target.encode_prompt("What is 17 * 23?")
    tokens = SpeculativeDecoder(target, proposer).generate(prompt, GenerationConfig(max_new_tokens=32)).tokens
    print(f"{mode} {dtype} {method}: resident {rss} MB (anonymous {anon}, file-backed {file_backed}); "
          f"tokens {hash(tuple(tokens)) & 0xFFFFFFFF:08x}")


if __name__ == "__main__":
    main()
