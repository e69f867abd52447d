"""vLLM's offline speculative-decoding example as its users write it, with only the imports changed to dflash's:
two prompts through `LLM(model=..., speculative_config=...)`, then the mean acceptance length and each position's
acceptance read from `llm.get_metrics()` by vLLM's metric names.

    .venv/bin/python scripts/vllm_spec_decode_example.py
"""

from dflash import LLM, SamplingParams
from dflash.spec_metrics import Counter, Vector

SPECULATIVE_TOKENS = 15


def main() -> None:
    prompts = ["What is 17 * 23? Think step by step.", "Write a haiku about the sea."]
    llm = LLM(model="smollm2-135m",
              speculative_config={"method": "dflash", "num_speculative_tokens": SPECULATIVE_TOKENS})
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64))
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
    num_drafts = num_accepted = 0
    acceptance_counts = [0] * SPECULATIVE_TOKENS
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            assert isinstance(metric, Counter)
            num_drafts += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            assert isinstance(metric, Counter)
            num_accepted += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            assert isinstance(metric, Vector)
            for position, count in enumerate(metric.values):
                acceptance_counts[position] += count
    print(f"mean acceptance length: {1 + num_accepted / max(1, num_drafts):.2f}")
    for position in range(4):
        print(f"acceptance at token {position}: {acceptance_counts[position] / max(1, num_drafts):.2f}")


if __name__ == "__main__":
    main()
