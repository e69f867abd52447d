"""The target's own frequent continuations (methods/continuations.py), prompt lookup's fallback."""

from types import SimpleNamespace

import numpy as np
import pytest

from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.methods import continuations
from dflash.methods.continuations import ContinuationTable, shipped_table
from dflash.methods.ngram import TABLE_LABEL, NgramProposer

PROMPTS = ["w1 w2 w3 w4 w5", "w20 w31 w9 w9 w40 w12 w3", "w5"]


def test_the_most_frequent_continuation_is_kept_where_it_is_frequent_enough():
    sequences = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5],  # 4 after 1 2 3: twice of three
                 [7, 8, 9, 10],  # seen once: dropped (MIN_COUNT 2)
                 [5, 6, 7, 1], [5, 6, 7, 1], [5, 6, 7, 2], [5, 6, 7, 2], [5, 6, 7, 3]]  # 2 of 5 each: under MIN_SHARE
    table = ContinuationTable.build(sequences, vocab_size=16)
    assert table.draft([0, 1, 2, 3], 5) == [4]
    assert table.draft([7, 8, 9], 5) == [] and table.draft([5, 6, 7], 5) == []
    assert len(table) == 1
    assert ContinuationTable.build(sequences, vocab_size=16, min_count=1, min_share=0.0).draft([7, 8, 9], 3) == [10]


def test_drafts_chain_the_continuations_up_to_the_count():
    sequences = [[1, 2, 3, 4, 5, 6, 7]] * 2
    table = ContinuationTable.build(sequences, vocab_size=16)
    assert table.draft([9, 1, 2, 3], 10) == [4, 5, 6, 7]  # then 5 6 7 has no continuation
    assert table.draft([1, 2, 3], 2) == [4, 5]
    assert table.draft([2, 3], 4) == []  # fewer tokens than a context
    assert ContinuationTable.build([[1, 2]], vocab_size=16).draft([1, 2, 3], 4) == []  # nothing long enough


def test_saved_and_loaded_tables_draft_alike(tmp_path):
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 6, size=200).tolist() for _ in range(20)]
    for vocab in (16, 70000):  # 16-bit and 32-bit storage
        table = ContinuationTable.build(sequences, vocab_size=vocab, min_count=1, min_share=0.0)
        table.save(tmp_path / str(vocab), {"corpus": "random"})
        loaded = ContinuationTable.load(tmp_path / str(vocab))
        assert len(loaded) == len(table) > 0 and loaded.vocab_size == vocab
        for s in sequences[:5]:
            assert loaded.draft(s[:50], 7) == table.draft(s[:50], 7)
    (tmp_path / "16" / continuations.INFO_FILE).write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="continuation table"):
        ContinuationTable.load(tmp_path / "16")
    with pytest.raises(ValueError, match="vocabularies up to"):
        ContinuationTable.build(sequences, vocab_size=(1 << continuations.TOKEN_BITS) + 1)


def test_prompt_lookup_first_the_table_where_the_prompt_has_no_match():
    table = ContinuationTable.build([[4, 5, 6, 7, 8]] * 2, vocab_size=16)
    lookup = NgramProposer(max_draft=3, table=table)
    found = lookup.propose([4, 5, 6, 9, 9, 4, 5, 6])  # 4 5 6 occurred before: prompt lookup, 3-token match
    assert found.tokens == [9, 9, 4] and found.label == 3
    fallback = lookup.propose([1, 2, 4, 5, 6])  # no earlier occurrence of any tail: the table
    assert fallback.tokens == [7, 8] and fallback.label == TABLE_LABEL
    assert NgramProposer(max_draft=3).propose([1, 2, 4, 5, 6]).tokens == []


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_table_drafts_leave_greedy_output_unchanged(tiny_targets, arch):
    """A table built from the target's own greedy text (so its drafts are often right) and one of random text
    (mostly wrong): either way, the output is the target's alone, and the right one's drafts are accepted."""
    target = tiny_targets[arch]
    config = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    outputs = {p: SpeculativeDecoder(target).generate(target.encode_prompt(p), config).tokens for p in PROMPTS}
    rng = np.random.default_rng(1)
    own = ContinuationTable.build(list(outputs.values()) * 2, vocab_size=target.vocab_size)
    noise = ContinuationTable.build([rng.integers(0, target.vocab_size, 400).tolist()] * 2,
                                    vocab_size=target.vocab_size)
    accepted = 0
    for table in (own, noise):
        for prompt, expected in outputs.items():
            proposer = NgramProposer(max_draft=5, table=table)
            result = SpeculativeDecoder(target, proposer).generate(target.encode_prompt(prompt), config)
            assert result.tokens == expected
            accepted += sum(a - 1 for a in result.stats.accept_lengths) if table is own else 0
    assert accepted > 0


def test_the_table_ships_for_the_registry_target_only(monkeypatch):
    smollm = SimpleNamespace(name="smollm2-135m", vocab_size=49152)
    table = shipped_table(smollm)
    assert table is not None and len(table) > 100_000
    assert table.draft([1, 2], 3) == []
    assert shipped_table(SimpleNamespace(name="smollm2-135m", vocab_size=1000)) is None  # another tokenizer
    assert shipped_table(SimpleNamespace(name="tiny-llama", vocab_size=49152)) is None
    monkeypatch.setenv("DFLASH_CONTINUATIONS", "0")
    assert shipped_table(smollm) is None


def test_reports_say_whether_the_lookup_had_a_table(tiny_targets, monkeypatch):
    """bench JSON and `generate --json` carry proposer.report: an `ngram` figure must say whether the table was on."""
    from dflash.loading import build_proposer
    from dflash.methods.base import MethodOptions

    target = tiny_targets["llama"]
    assert build_proposer("ngram", target)[0].report == {"continuation_table": "none"}
    composite, _ = build_proposer("dflash+ngram", target, MethodOptions(block_size=4))
    assert composite.report["continuation_table"] == "none" and "draft_dtype" in composite.report
    monkeypatch.setattr(target, "name", "smollm2-135m")
    monkeypatch.setattr(type(target), "vocab_size", property(lambda self: 49152))
    report = build_proposer("ngram", target)[0].report["continuation_table"]
    assert report.startswith("smollm2-135m-continuations (") and "contexts" in report
