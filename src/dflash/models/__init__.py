"""Models dflash runs: the target (our forward, or transformers as the fallback) and the building blocks and KV cache shared with the drafters."""
