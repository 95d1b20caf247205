"""How the harness samples a CUDA device (moe_bench.timing._time_with_events), with a stand-in
clock: events bracket whole rounds over the routings (one replay of the graph that holds a
forward of each), never a single forward; each batch of timed rounds is led by an untimed one;
a sample is the round's time per forward."""

from __future__ import annotations

from moe_bench import timing


class Clock:
    """A device stand-in: the forward of routing r takes 10 + r us; events read the clock when
    recorded; the log keeps what happened in order."""

    def __init__(self, routings: int):
        self.routings = routings
        self.now_us = 0.0
        self.log: list[str] = []

    def run_round(self) -> None:
        for r in range(self.routings):
            self.now_us += 10.0 + r
            self.log.append(f"r{r}")

    def event(self):
        clock = self

        class Event:
            at_us = None

            def record(self):
                self.at_us = clock.now_us
                clock.log.append("event")

            def elapsed_time(self, other) -> float:  # milliseconds, as torch.cuda.Event answers
                return (other.at_us - self.at_us) / 1e3

        return Event()

    def synchronize(self) -> None:
        self.log.append("sync")


def sample(clock: Clock, min_time_s: float = 0.0) -> list[float]:
    return timing._time_with_events(clock.run_round, clock.routings, "cuda:0", min_time_s, event=clock.event,
                                    synchronize=clock.synchronize)


def test_events_bracket_whole_rounds_led_by_an_untimed_round(monkeypatch):
    monkeypatch.setattr(timing, "MIN_SAMPLES", 3 * 4)
    monkeypatch.setattr(timing, "TIME_BUDGET_S", {"cuda": 3600.0, "cpu": 0.25})
    clock = Clock(3)
    samples = sample(clock)
    # MIN_SAMPLES forwards = 4 rounds of 3 routings: one batch of ROUNDS_PER_SYNC timed rounds.
    assert timing.ROUNDS_PER_SYNC == 4
    round_ = ["r0", "r1", "r2"]
    timed = ["event", *round_, "event"]
    assert clock.log == [*round_, *timed * 4, "sync"], clock.log
    # Per forward: (10 + 11 + 12) / 3 us; no event between two forwards, so nothing else counted.
    assert samples == [11.0] * 4


def test_sampling_goes_on_in_batches_until_enough_forwards(monkeypatch):
    monkeypatch.setattr(timing, "MIN_SAMPLES", 40)
    monkeypatch.setattr(timing, "TIME_BUDGET_S", {"cuda": 3600.0, "cpu": 0.25})
    clock = Clock(8)
    samples = sample(clock)
    # 40 forwards need 5 rounds of 8: two batches (each 1 untimed + 4 timed rounds), 8 samples.
    assert clock.log.count("sync") == 2
    assert len(samples) == 8
    assert sum(entry.startswith("r") for entry in clock.log) == 2 * 5 * 8
    assert all(abs(s - (10 + 3.5)) < 1e-9 for s in samples)


def test_sampling_stops_at_the_time_budget(monkeypatch):
    monkeypatch.setattr(timing, "MIN_SAMPLES", 10 ** 9)
    monkeypatch.setattr(timing, "TIME_BUDGET_S", {"cuda": 0.0, "cpu": 0.25})
    clock = Clock(2)
    samples = sample(clock)
    # Past the budget at once: one batch, every routing covered.
    assert clock.log.count("sync") == 1 and len(samples) == timing.ROUNDS_PER_SYNC


def test_sampling_lasts_the_least_time_however_many_forwards(monkeypatch):
    """Forty forwards of a small M take milliseconds; the GPU's clock settles over a second of
    sustained work, so the samples go on for MIN_TIME_S (0.5 s on a device) whatever their count,
    and stop within a batch of it (the stand-in's host clock moves 0.1 s a batch)."""
    assert timing.MIN_TIME_S["cuda"] == 0.5
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    clock = Clock(8)
    real_sync = clock.synchronize

    def synchronize():
        now[0] += 0.1
        real_sync()

    clock.synchronize = synchronize
    samples = sample(clock, min_time_s=timing.MIN_TIME_S["cuda"])
    assert clock.log.count("sync") == 5 and len(samples) == 5 * timing.ROUNDS_PER_SYNC
    # Without a least time (the rehearsal) the forty forwards are enough: two batches.
    now[0] = 0.0
    clock = Clock(8)
    clock.synchronize = synchronize
    assert len(sample(clock, min_time_s=0.0)) == 2 * timing.ROUNDS_PER_SYNC
    # Never past the budget, however long the least time.
    now[0] = 0.0
    clock = Clock(8)
    clock.synchronize = synchronize
    assert len(sample(clock, min_time_s=60.0)) == 20 * timing.ROUNDS_PER_SYNC  # 2.0 s at 0.1 s a batch
