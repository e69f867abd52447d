"""What the engine times when a target loads (timings.py): each choice made by timing on the machine at hand, once,
then read from the cache."""

import pytest

from dflash import timings
from dflash.engine import FIRST_LOGITS
from dflash.models import native
from dflash.models.screening import KINDS
from dflash.timings import WIDE_WIDTHS, measured_head_saving, measured_screening, measured_wide_from, wide_from_timings


def test_the_screen_is_chosen_by_timing_once_per_machine(tiny_targets, monkeypatch, tmp_path):
    """Timed targets time the float32 head's argmax against each screen after a step and keep the fastest (the
    other screens' copies of the head are dropped); the choice is cached per machine like the pass costs. An int8
    screen then has its inputs' width measured (measured_wide_from, tested below)."""

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    target = tiny_targets["llama"]
    monkeypatch.setattr(target, "measure", True)
    monkeypatch.setattr(target, "screen_kind", "bfloat16")
    greedy, calls, widths_measured = target.engine.greedy, [], []
    monkeypatch.setattr(target.engine, "greedy", lambda h, kind: calls.append(kind) or greedy(h, kind))
    monkeypatch.setattr(timings, "measured_wide_from", widths_measured.append)
    screens = measured_screening(target)
    assert sorted(set(calls)) == sorted(KINDS) and len(calls) == 8 * len(KINDS)
    kept = target.engine.__dict__["_screens"]
    if screens:
        assert target.screen_kind in KINDS and [key[0] for key in kept] == [target.screen_kind]
    else:
        assert kept == {}
    assert widths_measured == ([target] if screens and target.screen_kind == "int8" else [])
    assert measured_screening(target) == screens and len(calls) == 8 * len(KINDS)  # the second reads the cache
    monkeypatch.setattr(target, "measure", False)
    assert measured_screening(target) is True  # untimed targets screen wherever they can


def test_integer_screens_go_wide_from_the_measured_width(tiny_targets, monkeypatch, tmp_path):
    """The narrowest width from which wide inputs timed faster than dense ones at every wider width; that many rows
    and more go wide, in the screen measured and in screens made later for the head; measured once per machine."""

    timings = lambda wide, dense: {(w, m): t for w, (a, b) in zip((4, 8, 16), zip(wide, dense))  # noqa: E731
                                   for m, t in (("wide", a), ("dense", b))}
    widths = (4, 8, 16)
    assert wide_from_timings(timings((1, 1, 1), (2, 2, 2)), widths) == 4
    assert wide_from_timings(timings((3, 1, 1), (2, 2, 2)), widths) == 8
    assert wide_from_timings(timings((1, 3, 1), (2, 2, 2)), widths) == 16  # a loss at 8: wide only from 16
    assert wide_from_timings(timings((1, 1, 2), (2, 2, 2)), widths) == 10**9
    if not native.screen_wide():
        pytest.skip("no integer screen with wide inputs here (AVX512-VNNI)")
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    target = tiny_targets["llama"]
    monkeypatch.setattr(target, "measure", True)
    screen = target.engine.screen("int8")
    assert screen.wide_allowed
    calls = []
    greedy = target.engine.greedy
    monkeypatch.setattr(target.engine, "greedy", lambda h, kind: calls.append((h.shape[-2], screen.wide_from))
                        or greedy(h, kind))
    measured_wide_from(target)
    assert sorted(set(calls)) == sorted((w, m) for w in WIDE_WIDTHS for m in (1, 10**9))
    assert len(calls) == 10 * 2 * len(WIDE_WIDTHS)
    chosen = screen.wide_from
    assert chosen in (*WIDE_WIDTHS, 10**9)
    measured_wide_from(target)  # from the cache: nothing timed
    assert len(calls) == 10 * 2 * len(WIDE_WIDTHS) and screen.wide_from == chosen
    target.engine.__dict__["_screens"].clear()
    assert target.engine.screen("int8").wide_from == chosen


def test_head_saving_is_measured_once_per_machine(tiny_targets, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    target = tiny_targets["llama"]
    calls = []
    logits_of = target.logits_of
    monkeypatch.setattr(target, "logits_of", lambda h: calls.append(h.shape[1]) or logits_of(h))
    saving = measured_head_saving(target, FIRST_LOGITS)
    assert saving >= 0 and sorted(set(calls)) == [FIRST_LOGITS, 2 * FIRST_LOGITS] and len(calls) == 16
    assert measured_head_saving(target, FIRST_LOGITS) == saving and len(calls) == 16  # then from the cache
