"""The target's own frequent continuations (methods/continuations.py), prompt lookup's fallback."""

import json
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
    table = ContinuationTable.build(sequences, vocab_size=16, lengths=(3,))
    assert table.draft([0, 1, 2, 3], 5) == [4]
    assert table.draft([7, 8, 9], 5) == [] and table.draft([5, 6, 7], 5) == []
    assert len(table) == 1
    assert ContinuationTable.build(sequences, vocab_size=16, lengths=(3,), min_count=1,
                                   min_share=0.0).draft([7, 8, 9], 3) == [10]


def test_the_longest_known_context_decides_and_longer_ones_are_kept_only_where_they_differ():
    sequences = [[1, 2, 3, 4]] * 3 + [[9, 2, 3, 7]] * 2  # after 2 3: 4 (3 of 5); after 9 2 3 always 7
    table = ContinuationTable.build(sequences, vocab_size=16, lengths=(3, 2))
    assert table.draft([0, 1, 2, 3], 1) == [4] and table.draft([5, 2, 3], 1) == [4]  # backs off to 2 3
    assert table.draft([9, 2, 3], 1) == [7]
    assert table.draft([9, 2], 3) == [3, 7]  # the second draft reads the longest context, its own draft included
    # 2 tokens: 1 2 -> 3, 2 3 -> 4, 9 2 -> 3; 3 tokens: only 9 2 3 -> 7 (1 2 3 -> 4 is what 2 3 gives anyway)
    assert len(table) == 4 and len(table.tables[3][1]) == 1


def reference_continuation(sequences, window, lengths, min_count=2, min_share=0.5):
    """The back-off rule spelt out: the longest context of `window` whose most frequent continuation is frequent
    enough (ties: the smallest token) gives the next token."""
    for length in sorted(lengths, reverse=True):
        if len(window) < length:
            continue
        context, counts = tuple(window[-length:]), {}
        for s in sequences:
            for i in range(len(s) - length):
                if tuple(s[i: i + length]) == context:
                    counts[s[i + length]] = counts.get(s[i + length], 0) + 1
        if counts:
            token = min(counts, key=lambda t: (-counts[t], t))
            if counts[token] >= min_count and counts[token] >= min_share * sum(counts.values()):
                return token
    return None


def test_drafts_equal_the_back_off_rule_spelt_out():
    rng = np.random.default_rng(3)
    sequences = [rng.integers(0, 4, size=60).tolist() for _ in range(12)]
    lengths = (5, 3, 2)
    table = ContinuationTable.build(sequences, vocab_size=8, lengths=lengths)
    probes = [rng.integers(0, 4, size=int(rng.integers(1, 9))).tolist() for _ in range(150)]
    found = 0
    for window in probes + [s[:k] for s in sequences[:3] for k in range(1, 20)]:
        assert table.continuation(window) == reference_continuation(sequences, window, lengths)
        found += table.continuation(window) is not None
    assert found > 50


def test_drafts_chain_the_continuations_up_to_the_count():
    sequences = [[1, 2, 3, 4, 5, 6, 7]] * 2
    table = ContinuationTable.build(sequences, vocab_size=16)
    assert table.draft([9, 1, 2, 3], 10) == [4, 5, 6, 7]  # then 6 7 has no continuation
    assert table.draft([1, 2, 3], 2) == [4, 5]
    assert table.draft([2, 3], 4) == [4, 5, 6, 7]
    assert table.draft([3], 4) == []  # fewer tokens than the shortest context
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


def test_a_table_of_the_first_format_still_loads(tmp_path):
    """One context length, arrays `contexts` and `nexts` (what the twentieth session shipped)."""
    np.savez_compressed(tmp_path / continuations.TABLE_FILE, contexts=np.array([[1, 2, 3], [2, 3, 4]], np.uint16),
                        nexts=np.array([4, 5], np.uint16))
    (tmp_path / continuations.INFO_FILE).write_text(
        '{"format": "dflash-continuations-1", "context": 3, "vocab_size": 16}')
    table = ContinuationTable.load(tmp_path)
    assert table.draft([0, 1, 2, 3], 5) == [4, 5] and table.draft([2, 3], 5) == []


def test_prompt_lookup_first_the_table_where_the_prompt_has_no_match():
    table = ContinuationTable.build([[4, 5, 6, 7, 8]] * 2, vocab_size=16, lengths=(3,))
    lookup = NgramProposer(max_draft=3, table=table)
    found = lookup.propose([4, 5, 6, 9, 9, 4, 5, 6])  # 4 5 6 occurred before: prompt lookup, 3-token match
    assert found.tokens == [9, 9, 4] and found.label == 3
    fallback = lookup.propose([1, 2, 4, 5, 6])  # no earlier occurrence of any tail: the table
    assert fallback.tokens == [7, 8] and fallback.label == TABLE_LABEL
    assert NgramProposer(max_draft=3).propose([1, 2, 4, 5, 6]).tokens == []


def test_the_longest_and_shortest_match_are_vllms_prompt_lookup_max_and_min(tiny_targets):
    from dflash.methods.base import MethodOptions
    from dflash.methods.ngram import lookup_for

    sequence = [4, 5, 6, 9, 1, 5, 6]  # 5 6 occurred before (a 2-token match), and 6 alone
    assert NgramProposer(max_draft=3).propose(sequence).label == 2
    assert NgramProposer(max_draft=3, max_ngram=1).propose(sequence).label == 1  # prompt_lookup_max 1
    assert NgramProposer(max_draft=3, min_ngram=3).propose(sequence).tokens == []  # prompt_lookup_min 3: none
    lookup = lookup_for(tiny_targets["llama"], 3, MethodOptions(prompt_lookup_max=4, prompt_lookup_min=2))
    assert (lookup.max_ngram, lookup.min_ngram) == (4, 2)


def test_the_table_comes_before_a_one_token_prompt_match():
    table = ContinuationTable.build([[4, 5, 6, 7, 8]] * 2, vocab_size=16, lengths=(3,))
    lookup = NgramProposer(max_draft=3, table=table)
    weak = lookup.propose([6, 1, 2, 4, 5, 6])  # 6 occurred before (a 1-token match), and the table knows 4 5 6
    assert weak.tokens == [7, 8] and weak.label == TABLE_LABEL
    assert NgramProposer(max_draft=3).propose([6, 1, 2, 4, 5, 6]).label == 1
    unknown = lookup.propose([6, 1, 2, 3, 5, 6])  # the table has nothing: the 1-token match after all
    assert unknown.tokens == [1, 2, 3] and unknown.label == 1
    strong = lookup.propose([5, 6, 1, 4, 5, 6])  # a 2-token match (5 6) comes before the table
    assert strong.tokens == [1, 4, 5] and strong.label == 2


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
    accepted = from_table = 0
    for table in (own, noise):
        for prompt, expected in outputs.items():
            proposer = NgramProposer(max_draft=5, table=table)
            result = SpeculativeDecoder(target, proposer).generate(target.encode_prompt(prompt), config)
            assert result.tokens == expected
            assert result.stats.table_rounds <= result.stats.num_rounds
            accepted += sum(a - 1 for a in result.stats.accept_lengths) if table is own else 0
            from_table += result.stats.table_rounds if table is own else 0
    assert accepted > 0 and from_table > 0


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


def test_a_table_for_your_own_target_from_its_regenerated_corpus(tmp_path, capsys):
    """`dflash data --out DIR --table FOLDER` builds a table from a target's own regenerated responses, and
    `--continuations FOLDER` (or none) chooses prompt lookup's table in generate and bench; misuse is one line, exit 2."""
    from dflash.cli import main
    from dflash.testing import tiny_target

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"id": "p{i}", "prompt": "w{i} w{i + 1} w{i + 2} w3"}}\n' for i in range(12)))
    data, folder = tmp_path / "regenerated", tmp_path / "table"
    common = ["--target", "tiny-llama", "--device", "cpu"]
    assert main(["data", *common, "--out", str(data), "--input", str(prompts), "--max-new-tokens", "24",
                 "--batch-size", "4"]) == 0
    assert main(["data", *common, "--out", str(data), "--table", str(folder)]) == 0
    table = ContinuationTable.load(folder)
    assert len(table) > 0 and table.vocab_size == tiny_target("llama").vocab_size
    capsys.readouterr()

    def generate(*flags):
        code = main(["generate", *common, "--max-new-tokens", "16", "--json", *flags, "w1 w2 w3"])
        out, err = capsys.readouterr()
        return code, (json.loads(out) if code == 0 else err)

    code, payload = generate("--method", "ngram", "--continuations", str(folder))
    assert code == 0 and payload["drafter"]["continuation_table"].startswith("table (")
    assert 0 <= payload["table_rounds"] <= payload["num_rounds"]
    code, payload = generate("--method", "dflash+ngram", "--block-size", "4", "--continuations", "none")
    assert code == 0 and payload["drafter"]["continuation_table"] == "none"
    code, err = generate("--method", "ngram", "--continuations", str(tmp_path / "missing"))
    assert code == 2 and "no continuation table" in err and len(err.strip().splitlines()) == 1
    code, err = generate("--method", "dflash", "--continuations", str(folder))
    assert code == 2 and "applies to prompt lookup" in err
    table.vocab_size = 70000
    table.save(tmp_path / "other")
    code, err = generate("--method", "ngram", "--continuations", str(tmp_path / "other"))
    assert code == 2 and "vocabulary of 70000" in err
    code = main(["bench", *common, "--methods", "ar,dflash", "--continuations", str(folder), "--limit", "1",
                 "--dataset", str(prompts), "--out", str(tmp_path / "bench")])
    assert code == 2 and "add ngram or NAME+ngram" in capsys.readouterr().err
    assert main(["bench", *common, "--methods", "ar,ngram", "--continuations", str(folder), "--limit", "2",
                 "--max-new-tokens", "8", "--dataset", str(prompts), "--out", str(tmp_path / "bench"),
                 "--no-progress"]) == 0
    results = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert results["drafters"]["ngram"]["continuation_table"].startswith("table (")
    assert f"--continuations {folder}" in results["command"]
    assert main(["data", *common, "--out", str(data), "--table", str(folder), "--pack", str(tmp_path / "c")]) == 2
