"""What the engine times on this machine when a target loads, once per machine, model and kernel choice (cached
with the kernel plans, `models.target.cached_timing`): the cost of each verify pass width after a few context
lengths (the cost model's start), whether and through which screen greedy tokens come faster than the full LM head,
from how many rows the int8 screen's inputs go wide, and what a round saves by running its head in two steps.
Timed where the machine at hand decides, never assumed: a width or kernel that wins on one CPU loses on another."""

from __future__ import annotations

import time

import torch

from .control import nondecreasing

PASS_WIDTHS = (1, 2, 4, 8, 16)


# measured after these many tokens: a wide pass's share of attention grows with it. Three, the longest well past
# the others: the growth fitted to 64 and 512 alone was mostly noise (a float32 2-token pass priced at 1.96x a step
# after 2750 tokens where it cost 1.10x, and a repetitive 2750-token prompt's lookup never drafted; RESULTS.md,
# thirty-fifth session)
PASS_CONTEXTS = (64, 512, 1536)


def measured_pass_costs(target, first_logits: int, first_screened: int, widths=PASS_WIDTHS, repeats: int = 5,
                        contexts=PASS_CONTEXTS) -> dict[int, dict[int, float]]:
    """{context: {width: the cost of a target pass of that width relative to a 1-token pass}} after each of
    `contexts` tokens, timed at load (contexts and widths interleaved, the fastest of `repeats` runs of each;
    never cheaper for a wider pass) and cached per machine, model
    and kernel choice (`cached_timing`: measured again if taken on a busier machine): a few seconds, once (most of
    it the longest context's prompt). The controller's online estimates start from these
    instead of from their first readings. `first_logits`, `first_screened`: the positions a round's head or screen
    reads first (engine.py's FIRST_LOGITS, FIRST_SCREENED), as a round runs its pass."""
    from .models.target import cached_timing

    screened = target.screens  # greedy rounds read the head's screen (the cost a bench at T=0 meets)

    def timed_pass(cache, context: int, width: int) -> float:
        started = time.perf_counter()
        deferred = screened or (target.defers_logits and width > first_logits)  # as a round runs it, rejecting early
        out = target.forward(torch.tensor([[7] * width], device=target.device), cache,
                             logits_at="hidden" if deferred else "all")
        if screened:
            target.greedy_of(out.hidden[:, :first_screened]).tolist()  # the host sync a round has
        else:
            logits = target.logits_of(out.hidden[:, :first_logits]) if deferred else out.logits
            logits.argmax(-1).tolist()
        cache.truncate(context)
        return time.perf_counter() - started

    def measure() -> dict:
        fitting = sorted({max(1, min(c, target.max_context - max(widths) - 1)) for c in contexts})
        caches = {}
        for context in fitting:
            caches[context] = target.new_cache(capacity=context + max(widths) + 1)
            target.forward(torch.tensor([[5 + i % 50 for i in range(context)]], device=target.device),
                           caches[context])
        # every context's passes in each run: the machine's load moves between contexts measured one after the
        # other (a 16-token pass after 1536 tokens came out cheaper, relative to its step, than after 512). Each
        # pass's fastest run: other work only ever adds time, and more to a wide pass, bound by its arithmetic,
        # than to a step (the median of each run's ratio priced wide passes as a busy machine runs them, and
        # `make run` verified fewer drafts: tau 2.05 -> 1.92)
        times: dict[tuple[int, int], list[float]] = {(c, w): [] for c in fitting for w in widths}
        for run in range(repeats + 1):
            for context in fitting:
                for w in widths:
                    seconds = timed_pass(caches[context], context, w)
                    if run:
                        times[context, w].append(seconds)
        relative = {}
        for context in fitting:
            ratios = nondecreasing([min(times[context, w]) / min(times[context, widths[0]]) for w in widths])
            relative[str(context)] = {str(w): round(r, 4) for w, r in zip(widths, ratios)}
        return {"relative": relative}

    deferred = ":deferred" if target.defers_logits else ""  # rounds whose head stops early cost another curve
    deferred += ":screened" if screened else ""
    key = f"pass-costs-by-context:{','.join(map(str, contexts))}{deferred}"
    relative = cached_timing(target, key, measure)["relative"]
    return {int(c): {int(w): r for w, r in by_width.items()} for c, by_width in relative.items()}


def measured_screening(target, repeats: int = 7) -> bool:
    """Whether greedy tokens through a screen of the head (models/screening.py) come faster than the float32 head's
    argmax, and through which screen (sets `target.screen_kind`): each timed after a 1-token pass, as in a round
    (the pass evicts the head from the caches), on the hidden state of a real context. Timed once per machine,
    model and kernel choice (`cached_timing`); the untimed test targets screen in bfloat16 wherever they can, so
    every test of the engine goes through a screen (tests/test_screening.py checks the other one)."""
    from .models.screening import KINDS
    from .models.target import cached_timing, interleaved_medians

    if not target.can_screen:
        return False
    if not target.measure:
        return True

    def measure() -> dict:
        cache = target.new_cache(capacity=80)
        target.forward(torch.tensor([[5 + i % 50 for i in range(64)]], device=target.device), cache)
        step = torch.tensor([[7]], device=target.device)

        def round_with(choose):
            def timed():
                hidden = target.forward(step, cache, logits_at="hidden").hidden
                choose(hidden).tolist()
                cache.truncate(64)
            return timed

        calls = {"full": round_with(lambda h: target.logits_of(h).argmax(-1))}
        for kind in KINDS:
            calls[kind] = round_with(lambda h, kind=kind: target.engine.greedy(h, kind))
        medians = interleaved_medians(calls, repeats)
        best = min(medians, key=medians.get)
        return {"choice": best, **{name: round(seconds, 6) for name, seconds in medians.items()}}

    choice = cached_timing(target, "greedy-screen", measure)["choice"]
    target.engine.keep_screen(choice if choice != "full" else None)
    if choice == "full":
        return False
    target.screen_kind = choice
    if choice == "int8":
        measured_wide_from(target)
    return True


# English prose for timings that depend on real hidden states (how many tokens a screen lets through)
SAMPLE_TEXT = ("A baker sells loaves of bread for three dollars each and muffins for two dollars each. On Monday she "
               "sold forty loaves and twice as many muffins as loaves. How much money did she make on Monday? She sold "
               "40 loaves, so the loaves made 40 * 3 = 120 dollars. She sold 2 * 40 = 80 muffins, which made 80 * 2 = "
               "160 dollars. In total she made 120 + 160 = 280 dollars on Monday. The answer is 280. Next, write a short "
               "function that returns the largest number in a list, and explain how it works step by step.")
# the pass widths at which the integer screen is timed with wide inputs against dense: below 8 rows reading the head
# bounds it (4 rows' integer sums took 0.97-1.01x the old int16 kernel's, wide or dense), and wide inputs only add
# survivors
WIDE_WIDTHS = (8, 16)


def wide_from_timings(medians: dict[tuple[int, str], float], widths=WIDE_WIDTHS) -> int:
    """The narrowest of `widths` from which wide inputs timed faster than dense ones at it and at every wider
    width, per medians[(width, "wide" | "dense")]; a huge number where the widest did not."""
    wide_from = 10**9
    for width in sorted(widths, reverse=True):
        if medians[(width, "wide")] >= medians[(width, "dense")]:
            break
        wide_from = width
    return wide_from


def measured_wide_from(target, repeats: int = 9) -> None:
    """From how many rows the int8 screen's inputs go wide (native.c, "the int8 screen in integers"; sets its
    `wide_from`). Wide inputs halve the screen's integer work but let ~4x as many tokens through to float32 sums:
    that pays only where the sums, not reading the head, bound its time, which depends on the machine. Each width
    of WIDE_WIDTHS is timed after a pass of that width over English prose (as in a round, the pass evicts the head),
    wide against dense, interleaved; cached per machine like the screen's choice."""
    from .models import native
    from .models.target import cached_timing

    screen = target.engine.screen("int8")
    if screen is None or not screen.wide_allowed or not target.measure or target.tokenizer is None:
        return

    def measure() -> dict:
        tokens = torch.tensor([target.tokenizer(SAMPLE_TEXT)["input_ids"]], device=target.device)
        context = tokens.shape[1] - max(WIDE_WIDTHS)
        cache = target.new_cache(capacity=tokens.shape[1] + 1)
        target.forward(tokens[:, :context], cache)
        times: dict[tuple[int, str], list[float]] = {}
        for run in range(repeats + 1):  # interleaved; only the screen timed (a pass's time varies by more)
            for width in WIDE_WIDTHS:
                for mode in ("wide", "dense") if run % 2 else ("dense", "wide"):
                    hidden = target.forward(tokens[:, context:context + width], cache, logits_at="hidden").hidden
                    screen.wide_from = 1 if mode == "wide" else 10**9
                    started = time.perf_counter()
                    target.engine.greedy(hidden, "int8")
                    if run:
                        times.setdefault((width, mode), []).append(time.perf_counter() - started)
                    cache.truncate(context)
        medians = {key: sorted(t)[len(t) // 2] for key, t in times.items()}
        return {"wide_from": wide_from_timings(medians),
                **{f"{mode}{width}": round(seconds, 6) for (width, mode), seconds in medians.items()}}

    target.engine.set_wide_from(cached_timing(target, f"screen-wide-from:{native.build_id()}", measure)["wide_from"])


def measured_head_saving(target, first_logits: int, repeats: int = 7) -> float:
    """How much more the LM head costs on 2 x `first_logits` positions than on `first_logits` (engine.py's
    FIRST_LOGITS), as a fraction (0.3: 30% more): what a 16-token round saves when it rejects within its first
    `first_logits` positions, and so the largest share of rounds that may need the second step before the stepped
    head loses. Timed at load, cached per machine, model and kernel choice like the pass costs (`cached_timing`)."""
    from .models.target import cached_timing, interleaved_medians

    def measure() -> dict:
        hidden = torch.randn(1, 2 * first_logits, target.hidden_size, dtype=target.dtype, device=target.device)
        first, both = interleaved_medians(
            {rows: lambda rows=rows: target.logits_of(hidden[:, :rows]).argmax(-1).tolist()
             for rows in (first_logits, 2 * first_logits)}, repeats).values()
        return {"saving": round(max(0.0, both / first - 1), 4)}

    return cached_timing(target, "head-saving", measure)["saving"]
