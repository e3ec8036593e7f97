from slurm_dlrm.service.loop import LoopControl, run_loop


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        assert s >= 0
        self.now += max(s, 0.001)


def test_rounds_on_timer_and_wake_and_stop():
    clock = FakeClock()
    control = LoopControl()
    starts = []

    def round_fn():
        starts.append(clock.now)
        if len(starts) == 2:
            control.wake = True  # e.g. a submit during the round
        if len(starts) == 4:
            control.stop = True
        return None

    n = run_loop(round_fn, control, round_seconds=10.0, min_gap_s=0.5, clock=clock, sleep=clock.sleep)
    assert n == 4
    assert starts[0] == 0.0
    assert abs(starts[1] - 10.0) < 0.2
    assert abs(starts[2] - 10.5) < 0.2  # the wake, not sooner than min_gap_s
    assert abs(starts[3] - 20.5) < 0.2


def test_delay_hint_and_failing_round_go_on():
    clock = FakeClock()
    control = LoopControl()
    starts = []

    def round_fn():
        starts.append(clock.now)
        if len(starts) == 1:
            raise RuntimeError("slurm exploded")
        return 2.0  # back-off hint shorter than the round

    n = run_loop(round_fn, control, round_seconds=10.0, clock=clock, sleep=clock.sleep, max_rounds=3)
    assert n == 3
    assert abs(starts[1] - 10.0) < 0.2 and abs(starts[2] - 12.0) < 0.2
