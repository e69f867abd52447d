"""Predicted Outputs (prediction.py, OpenAI's `prediction`): the prediction kept aligned with the output through
edits; drafted by every method with a drafter or a lookup, and never changing a token, greedy or sampled, whatever
the prediction; the server's usage counts, the LLM and the CLI."""

import json

import pytest

from conftest import ARCHS, OracleProposer
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.errors import UserError
from dflash.methods.ngram import NgramProposer
from dflash.prediction import MIN_MATCH, PREDICTION_LABEL, PredictedOutput, prediction_ids
from dflash.sampling import SamplingConfig

PREDICTED = list(range(100, 130))


def drafts(prediction: PredictedOutput, output: list[int], count=4) -> list[int]:
    draft = prediction.propose(output, count)
    assert draft.label == PREDICTION_LABEL or not draft.tokens
    return draft.tokens


def test_the_prediction_follows_the_output_through_edits():
    prediction = PredictedOutput(PREDICTED)
    assert drafts(prediction, [100]) == [101, 102, 103, 104]  # on track from its first token
    assert drafts(prediction, [100, 101, 102]) == [103, 104, 105, 106]
    inserted = [100, 101, 102, 7, 8]  # an edit the prediction lacks: lost until the output finds its text again
    assert drafts(prediction, inserted) == []
    assert drafts(prediction, inserted + [103, 104]) == []  # a tail shorter than MIN_MATCH tokens is no anchor
    assert MIN_MATCH == 3 and drafts(prediction, inserted + [103, 104, 105]) == [106, 107, 108, 109]
    skipped = inserted + [103, 104, 105, 106, 115, 116, 117]  # a deletion: found further on
    assert drafts(prediction, skipped) == [118, 119, 120, 121]
    assert drafts(prediction, skipped + list(range(118, 130))) == []  # nothing left to predict
    repeated = PredictedOutput([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3, 7])
    assert drafts(repeated, [1, 2, 3, 9, 1, 2, 3, 8, 5], 2) == [1, 2]
    assert drafts(repeated, [1, 2, 3, 9, 1, 2, 3, 8, 5, 4, 1, 2, 3], 1) == [7]  # forward of where it was, not back
    assert drafts(PredictedOutput(PREDICTED), [5, 6, 7]) == []


def test_prediction_ids_take_openais_shapes():
    from dflash.testing import tiny_byte_tokenizer

    tokenizer = tiny_byte_tokenizer(320)
    ids = prediction_ids(tokenizer, "def f():")
    assert ids and prediction_ids(tokenizer, {"type": "content", "content": "def f():"}) == ids
    assert prediction_ids(tokenizer, {"type": "content", "content": [{"type": "text", "text": "def "},
                                                                     {"type": "text", "text": "f():"}]}) == ids
    assert prediction_ids(tokenizer, None) == () == prediction_ids(tokenizer, "")
    for bad, fragment in [({"type": "image", "content": "x"}, "must be \"content\""), ({"content": [3]}, "parts"),
                          ({"type": "content", "content": 3}, "prediction must be")]:
        with pytest.raises(UserError, match=fragment):
            prediction_ids(tokenizer, bad)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_prediction_never_changes_the_output(byte_targets, arch, monkeypatch):
    """Greedy and seeded: the exact output, an edited one and an unrelated one as predictions give the tokens of
    no prediction with every proposer; the exact one is drafted and accepted most of the way."""
    from test_control import FakeClock

    target = byte_targets[arch]
    prompt = target.encode_prompt("Write it again.")
    for sampling in (SamplingConfig(), SamplingConfig(temperature=0.9, seed=5)):
        config = GenerationConfig(48, sampling=sampling, ignore_eos=True)
        plain = SpeculativeDecoder(target).generate(prompt, config)
        edited = plain.tokens[:15] + [40, 41, 42, 43] + plain.tokens[20:]
        unrelated = [next(t for t in range(300, 0, -1) if t not in plain.tokens)] * 30
        for predicted in (plain.tokens, edited, unrelated):
            predicting = GenerationConfig(48, sampling=sampling, ignore_eos=True, prediction=tuple(predicted))
            for proposer in (NgramProposer(max_draft=7), OracleProposer(edited, len(prompt), 5)):
                with monkeypatch.context() as patched:  # costs that a busy machine cannot change
                    clock = FakeClock()
                    clock.install(patched, target, proposer)
                    result = SpeculativeDecoder(target, proposer, timer=clock).generate(prompt, predicting)
                assert result.tokens == plain.tokens, (sampling, predicted[:3], proposer.name)
                if predicted is unrelated:
                    assert result.stats.prediction_accepted == 0
                if predicted is plain.tokens and isinstance(proposer, NgramProposer):
                    assert result.stats.prediction_accepted >= len(plain.tokens) // 2
                    assert result.stats.num_rounds <= len(plain.tokens) // 3
        assert SpeculativeDecoder(target).generate(prompt, predicting).tokens == plain.tokens  # ar: no drafts


def test_the_server_counts_a_predictions_tokens(byte_targets, monkeypatch):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    import dflash.engine
    from dflash.serving import BackgroundServer, create_app
    from test_control import FakeClock

    target, proposer, clock = byte_targets["llama"], NgramProposer(max_draft=7), FakeClock()
    clock.install(monkeypatch, target, proposer)  # costs that a busy machine cannot change: the same choices

    class Clocked(dflash.engine.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, timer=clock, **kwargs)

    monkeypatch.setattr(dflash.engine, "Engine", Clocked)
    with BackgroundServer(create_app(target, proposer, "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(**kwargs):
            return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Again?"}],
                                                  max_tokens=40, temperature=0, **kwargs)

        plain = ask()
        assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
        expected = plain.choices[0].message.content
        predicted = ask(prediction={"type": "content", "content": expected})
        assert predicted.choices[0].message.content == expected
        details = predicted.usage.completion_tokens_details
        assert details.accepted_prediction_tokens >= 10 and details.rejected_prediction_tokens >= 0
        chunks = list(ask(prediction={"type": "content", "content": [{"type": "text", "text": expected}]},
                          stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens >= 10
        completion = client.completions.create(model="tiny", prompt="Again?", max_tokens=20, temperature=0,
                                               extra_body={"prediction": {"type": "content", "content": "x"}})
        assert completion.usage.completion_tokens == 20
        response = client.responses.create(model="tiny", input="Again?", max_output_tokens=40, temperature=0)
        predicted = client.responses.create(model="tiny", input="Again?", max_output_tokens=40, temperature=0,
                                            extra_body={"prediction": {"type": "content",
                                                                       "content": response.output_text}})
        assert predicted.output_text == response.output_text
        with pytest.raises(openai.BadRequestError, match="prediction type"):
            ask(prediction={"type": "file", "content": "x"})
        import httpx

        metrics = httpx.get(f"{url}/metrics").text
        accepted = next(line for line in metrics.splitlines()
                        if line.startswith('dflash_prediction_tokens_total{outcome="accepted"}'))
        assert float(accepted.split()[-1]) >= 30  # three replies' accepted drafts at least


def test_llm_and_generate_take_a_prediction(tmp_path, capsys):
    from dflash.cli import main
    from dflash.llm import LLM

    llm = LLM("tiny-qwen2-bytes", method="ngram")
    plain = llm.generate("Hi?", 30)
    again = llm.generate("Hi?", 30, prediction=plain.text)
    assert again.tokens == plain.tokens  # how much it drafted follows this machine's timings: the engine tests
    other = llm.generate("Ho?", 30)
    both = llm.generate(["Hi?", "Ho?"], 30, prediction=[plain.text, other.text])  # one each
    assert [r.tokens for r in both] == [plain.tokens, other.tokens]
    with pytest.raises(UserError, match="one each"):
        llm.generate(["Hi?", "Ho?"], 30, prediction=[plain.text])
    chatted = llm.chat([{"role": "user", "content": "Hi?"}], 30)
    assert llm.chat([{"role": "user", "content": "Hi?"}], 30, prediction=chatted.text).text == chatted.text
    argv = ["generate", "--target", "tiny-qwen2-bytes", "--method", "ngram", "--max-new-tokens", "30", "--json"]
    assert main(argv + ["Hi?"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    (tmp_path / "expected.txt").write_text(text)
    assert main(argv + ["--prediction", str(tmp_path / "expected.txt"), "Hi?"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == text and out["accepted_prediction_tokens"] >= 0 and "rejected_prediction_tokens" in out
    rows = [{"id": "p", "prompt": "Hi?", "prediction": {"type": "content", "content": text}},
            {"id": "q", "prompt": "Hi?"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    batch = ["batch", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--target",
             "tiny-qwen2-bytes", "--method", "ngram", "--max-new-tokens", "30", "--no-progress"]
    assert main(batch) == 0
    answers = [json.loads(line)["text"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert answers == [text, text]
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "Hi?", "prediction": {"type": "x"}}) + "\n")
    assert main(batch[:3] + [str(tmp_path / "other.jsonl")] + batch[4:]) == 2
    assert "in.jsonl:1: prediction type" in capsys.readouterr().err


def test_requests_start_from_what_earlier_predictions_taught(byte_targets, monkeypatch):
    """A finished request's acceptance of its prediction folds into a prior of at most PREDICTION_PRIOR_TRIALS trials
    a position, which the next request with a prediction starts from (and then learns its own)."""
    from dflash.engine import PREDICTION_PRIOR_TRIALS, Engine
    from test_control import FakeClock

    target, proposer, clock = byte_targets["llama"], NgramProposer(max_draft=7), FakeClock()
    clock.install(monkeypatch, target, proposer)
    engine = Engine(target, proposer, timer=clock)
    prompt = target.encode_prompt("Write it again.")
    plain = engine.submit(prompt, GenerationConfig(48, ignore_eos=True))
    engine.run()
    predicting = GenerationConfig(48, ignore_eos=True, prediction=tuple(plain.result.tokens))
    first = engine.submit(prompt, predicting)
    assert sum(first.controller.lookup_calibration._positions(PREDICTION_LABEL)[0]) == 0  # nothing learnt yet
    engine.run()
    tried, hits = engine._calibration("prediction")._positions(PREDICTION_LABEL)
    assert 0 < max(tried) <= PREDICTION_PRIOR_TRIALS and sum(hits) / sum(tried) > 0.8
    second = engine.submit(prompt, predicting)
    assert second.controller.lookup_calibration._positions(PREDICTION_LABEL) == (tried, hits)
    engine.run()
    assert second.result.tokens == plain.result.tokens
    assert second.result.stats.num_rounds <= first.result.stats.num_rounds
