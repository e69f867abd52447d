"""OpenAI's Predicted Outputs: a request may send the text it expects back (`prediction`: a file with a few edits
made, a document to be reformatted), and its tokens are drafted where the output follows them. Speculative
decoding makes this lossless for free: the target verifies every draft, so a wrong prediction costs a verify
pass's extra width and never changes a token.

The prediction is kept aligned with the output: while the output writes the prediction's tokens the drafts are the
ones after them; where it departs (an edit), the output's last tokens are looked for in the prediction (the longest
tail first, from MAX_MATCH down to MIN_MATCH tokens, forward of where the output left it, then anywhere), and the
drafts go on after the match, so an edit's end finds the unchanged text again. The drafts are labelled apart
(PREDICTION_LABEL) and the engine prices them against the drafter's and prompt lookup's like any free draft, with
their own acceptance learnt per request (a prediction is as good as its request made it), from a light prior of
what earlier requests' predictions were worth (engine.Engine._learn_prediction_prior).
"""

from __future__ import annotations

from array import array

from .methods.base import Draft

PREDICTION_LABEL = -2  # Draft.label of a prediction's drafts (TABLE_LABEL 0, GRAMMAR_LABEL -1)
MAX_MATCH, MIN_MATCH = 8, 3  # output tails looked for in the prediction to find its place again


class PredictedOutput:
    """One request's prediction (token ids) and where the output stands in it."""

    def __init__(self, tokens: list[int], prior: tuple[list[float], list[float]] = ((), ())):
        self.tokens = list(tokens)
        self.prior = prior  # the calibration counts its drafts started from (Engine._learn_prediction_prior)
        self.words = array("i", self.tokens).tobytes()  # searched as 4-byte words in C (bytes.find)
        self.at: int | None = 0  # the prediction's token that would come next, None where the output left it
        self.furthest = 0  # the furthest place the output was seen at
        self.seen = 0  # the output's length when `at` was last set

    def propose(self, output: list[int], count: int) -> Draft:
        """Up to `count` drafts after `output` (the generated tokens so far), or none where it has left the
        prediction and no tail of it is found there."""
        self._follow(output)
        if self.at is None or count <= 0:
            return Draft([])
        return Draft(self.tokens[self.at: self.at + count], label=PREDICTION_LABEL)

    def _follow(self, output: list[int]) -> None:
        new = output[self.seen:]
        if self.at is not None and self.tokens[self.at: self.at + len(new)] == new:
            self.at += len(new)
        else:
            self.at = self._found(output)
        if self.at is not None:
            self.furthest = max(self.furthest, self.at)
        self.seen = len(output)

    def _found(self, output: list[int]) -> int | None:
        """The place after the longest tail of `output` found in the prediction: forward of the furthest place
        seen first (text before it was written already), else the first anywhere; None where none is."""
        for n in range(min(MAX_MATCH, len(output)), MIN_MATCH - 1, -1):
            tail = array("i", output[-n:]).tobytes()
            for start in (self.furthest, 0):
                at = first_word_match(self.words, tail, 4 * start)
                if at >= 0 and at + n < len(self.tokens):  # something follows it to draft
                    return at + n
        return None


def first_word_match(words: bytes, tail: bytes, start: int) -> int:
    """The token index of the first occurrence of `tail` in words[start:] that starts on a token (4-byte)
    boundary; -1 if none."""
    at = words.find(tail, start)
    while at >= 0 and at % 4:  # a match across token boundaries: look after it
        at = words.find(tail, at + 1)
    return at // 4 if at >= 0 else -1


def prediction_text(prediction) -> str:
    """The text of OpenAI's `prediction` ({"type": "content", "content": text or [{"type": "text", "text": ...}]};
    plain text too, as `LLM` and the CLI take it); "" for none. UserError for another shape."""
    from .errors import UserError

    if prediction is None:
        return ""
    if isinstance(prediction, dict):
        if prediction.get("type", "content") != "content":
            raise UserError(f"prediction type must be \"content\", got {prediction.get('type')!r}")
        prediction = prediction.get("content")
    if isinstance(prediction, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in prediction):
            raise UserError("prediction content must be text, or a list of {\"type\": \"text\", \"text\": ...} parts")
        prediction = "".join(part["text"] for part in prediction)
    if not isinstance(prediction, str):
        raise UserError("prediction must be {\"type\": \"content\", \"content\": TEXT}")
    return prediction


def prediction_ids(tokenizer, prediction) -> tuple[int, ...]:
    """The token ids of a prediction (prediction_text's shapes); () for none."""
    text = prediction_text(prediction)
    return tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()
