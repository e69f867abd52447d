"""llama.cpp in a process of its own, for `dflash bench`'s llamacpp baseline (bench_runners.LlamaCppRunner).

A crash in llama.cpp's native code ends this process, not the benchmark: a llama-cpp-python built with
GGML_NATIVE=ON died of SIGILL in its AMX path on the registry's Q4_1 file (Intel Xeon, family 6 model 207), and took
every other method's results with it. Run as a script (`python llamacpp_worker.py MODEL N_CTX THREADS SEED`), so it
imports llama_cpp and nothing of dflash. One JSON object a line each way: a request {"prompt", "max_new", "eos",
"ignore_eos", "temperature", "top_p"} gets {"tokens", "ttft", "total"}, timed here as the in-process runner timed it;
the first line out is {"ready": true} or {"error": "..."}.
"""

import json
import os
import sys
import time


def generate(llm, prompt: list[int], max_new: int, eos: list[int], ignore_eos: bool, temperature: float,
             top_p: float) -> dict:
    llm.reset()
    tokens, first_at, stops = [], None, set(eos)
    start = time.perf_counter()
    for token in llm.generate(prompt, temp=temperature, top_k=1 if temperature == 0 else 40, top_p=top_p,
                              reset=True):
        first_at = first_at or time.perf_counter()
        tokens.append(int(token))
        if len(tokens) >= max_new or (token in stops and not ignore_eos):
            break
    total = time.perf_counter() - start
    return {"tokens": tokens, "ttft": (first_at or time.perf_counter()) - start, "total": total}


def main(argv: list[str]) -> int:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever llama.cpp prints goes to stderr, not into the replies
    model, n_ctx, threads, seed = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    try:
        from llama_cpp import Llama

        llm = Llama(model_path=model, n_ctx=n_ctx, n_threads=threads, n_batch=512, verbose=False, seed=seed)
    except Exception as exc:  # reported by the benchmark as the user's problem (a bad file, a broken install)
        replies.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return 1
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        replies.write(json.dumps(generate(llm, **json.loads(line))) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
