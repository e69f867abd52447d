"""The thread chooser (threads.py): it stays on n threads on a quiet machine with rare probes, moves to n - 1 when
passes there cost less (another process holds a core) and back when the load goes, ignores one lucky probe, keeps
its hands off pinned or single-thread or non-CPU setups, and inside the engine changes speed, never tokens."""

import torch

from dflash import threads
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.threads import FIRST_PROBE, MAX_GAP, PROBE_EVERY, ThreadChooser

from conftest import OracleProposer


class Machine:
    """Pass costs by thread count; records every count the chooser sets."""

    def __init__(self, costs: dict[int, float]):
        self.costs, self.now, self.set = costs, 2, []

    def set_threads(self, count: int) -> None:
        self.now = count
        self.set.append(count)

    def run(self, chooser: ThreadChooser, passes: int) -> list[int]:
        """The count each pass ran on."""
        ran = []
        for _ in range(passes):
            chooser.before_pass()
            ran.append(self.now)
            chooser.after_pass(self.costs[self.now])
        return ran


def test_a_quiet_machine_stays_on_all_threads_and_probes_less_and_less():
    machine = Machine({2: 1.0, 1: 1.6})
    chooser = ThreadChooser((2, 1), machine.set_threads)
    ran = machine.run(chooser, 1000)
    assert chooser.current == 2 and chooser.switches == 0
    probes = [i for i, count in enumerate(ran) if count == 1]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == MAX_GAP  # backing off, to one probe in MAX_GAP passes
    assert len(probes) < 0.02 * len(ran)
    assert machine.now == 2  # every probe put the count back


def test_a_busy_core_moves_to_one_thread_fewer_and_back_when_it_frees():
    machine = Machine({2: 2.0, 1: 1.0})
    chooser = ThreadChooser((2, 1), machine.set_threads)
    ran = machine.run(chooser, 3 * PROBE_EVERY)
    assert chooser.current == 1 and ran[-PROBE_EVERY:].count(1) >= PROBE_EVERY - 1
    assert ran.index(1) == FIRST_PROBE - 1 and ran[FIRST_PROBE:FIRST_PROBE + 2] == [2, 1]  # probe, pass, confirm
    machine.costs = {2: 1.0, 1: 1.6}  # the other job ended
    ran = machine.run(chooser, 2 * MAX_GAP + 2 * PROBE_EVERY)
    assert chooser.current == 2 and chooser.switches == 2 and ran[-PROBE_EVERY:].count(2) >= PROBE_EVERY - 1


def test_one_lucky_probe_does_not_switch():
    costs = iter([1.0] * (FIRST_PROBE - 1) + [0.5] + [1.0] + [1.3] * 200)  # a fast probe, then a slow one
    chooser = ThreadChooser((2, 1), lambda count: None)
    for cost in [next(costs) for _ in range(PROBE_EVERY + 30)]:
        chooser.before_pass()
        chooser.after_pass(cost)
    assert chooser.current == 2 and chooser.switches == 0 and chooser.probes >= 2


def test_a_slow_first_pass_on_a_quiet_machine_does_not_switch():
    """The first pass of a generation can cost several times a steady one; the early probe is held to the
    cheapest pass before it."""
    machine = Machine({2: 1.0, 1: 1.6})
    chooser = ThreadChooser((2, 1), machine.set_threads)
    chooser.before_pass()
    chooser.after_pass(4.0)  # a cold start
    machine.run(chooser, 200)
    assert chooser.current == 2 and chooser.switches == 0


def test_pinned_single_thread_or_gpu_setups_get_no_chooser(monkeypatch):
    before = torch.get_num_threads()
    try:
        threads.unpin()
        torch.set_num_threads(2)
        assert threads.chooser_for("cpu").counts == (2, 1)
        assert threads.chooser_for("cuda:0") is None
        torch.set_num_threads(1)
        assert threads.chooser_for("cpu") is None
        torch.set_num_threads(2)
        threads.pin()
        assert threads.chooser_for("cpu") is None
    finally:
        threads.pin()
        torch.set_num_threads(before)


def test_in_the_engine_a_cheaper_count_is_taken_and_tokens_do_not_change(tiny_targets, monkeypatch):
    """Two threads are made to look slow (the timer charges a pass by the torch thread count it ran on): the engine
    moves to one thread, and generates exactly the tokens of a pinned run."""
    target = tiny_targets["llama"]
    config = GenerationConfig(max_new_tokens=60, ignore_eos=True)
    prompt = target.encode_prompt("w3 w9 w27")
    pinned = SpeculativeDecoder(target).generate(prompt, config).tokens
    clock = [0.0]

    def timer():  # half a pass's cost per reading: the engine reads the timer before and after each pass
        clock[0] += {1: 0.5, 2: 1.0}.get(torch.get_num_threads(), 1.0)
        return clock[0]

    before = torch.get_num_threads()
    try:
        threads.unpin()
        torch.set_num_threads(2)
        decoder = SpeculativeDecoder(target, timer=timer)
        chosen = decoder.generate(prompt, config).tokens
        assert decoder.engine.threads.current == 1 and decoder.engine.threads.switches == 1
        assert torch.get_num_threads() == 2  # given back after every step
        assert chosen == pinned
        oracle = OracleProposer(pinned, len(prompt), 4)
        assert SpeculativeDecoder(target, oracle, timer=timer).generate(prompt, config).tokens == pinned
    finally:
        threads.pin()
        torch.set_num_threads(before)


def test_bench_reports_each_method_s_chooser_and_none_when_pinned(tmp_path):
    import json

    from dflash.cli import main

    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "w3 w9"}\n{"prompt": "w27 w4 w1"}\n')
    before = torch.get_num_threads()
    try:
        for pin, name in ((False, "auto"), (True, "pinned")):
            threads.unpin()
            torch.set_num_threads(2)
            extra = ["--threads", "2"] if pin else []
            assert main(["bench", "--target", "tiny-llama", "--device", "cpu", "--dataset", str(dataset), "--methods",
                         "ar,ngram", "--max-new-tokens", "8", "--out", str(tmp_path / name), "--no-progress",
                         *extra]) == 0
            reported = json.loads((tmp_path / name / "results.json").read_text())["threads"]
            if pin:
                assert reported == {}
            else:
                assert set(reported) == {"ar", "ngram"} and all(r["counts"] == [2, 1] for r in reported.values())
                assert torch.get_num_threads() == 2
    finally:
        threads.pin()
        torch.set_num_threads(before)
