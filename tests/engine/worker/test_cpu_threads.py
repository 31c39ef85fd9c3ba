"""engine.worker.cpu_threads: the /proc readers, and the governor that gives OpenMP threads up
to a busy neighbour and takes them back."""
import os

from engine.worker.cpu_threads import (ThreadGovernor, read_cpu_busy, read_running_tasks,
                                       read_self_ticks)


def test_proc_readers_on_this_host():
    busy = read_cpu_busy(frozenset(os.sched_getaffinity(0)))
    own = read_self_ticks()
    assert busy is not None and busy > 0 and own is not None and own >= 0
    assert read_running_tasks() >= 1  # this test's own thread is running


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_governor_gives_up_threads_to_a_busy_neighbour_and_takes_them_back():
    """Fed /proc-like counters: 100 ticks a second per CPU. We use ~1 CPU ourselves; a
    neighbour's load on our CPUs comes and goes."""
    clock, state = _Clock(), {"busy": 0, "own": 0, "running": 1}
    gov = ThreadGovernor(max_threads=4, cpus=frozenset(range(4)), clock=clock,
                         read_busy=lambda cpus: state["busy"], read_self=lambda: state["own"],
                         read_running=lambda: state["running"], ticks_per_s=100.0)

    def second(own_cpus: float, neighbour_cpus: float):
        clock.now += 1.0
        state["own"] += int(100 * own_cpus)
        state["busy"] += int(100 * (own_cpus + neighbour_cpus))
        return gov.update()

    assert gov.update() is None                # first sample: nothing to compare yet
    assert second(3.9, 0.0) is None            # quiet: all 4 threads stay
    assert second(3.0, 1.0) is None            # one busy neighbour: one sample is not enough
    assert second(3.0, 1.0) == 3               # ... two are: 3 threads
    assert gov.threads == 3
    state["busy"] += 300                       # a burst within the same interval:
    assert gov.update() is None                # sampled at most once per interval
    state["busy"] -= 300
    assert second(2.0, 2.1) is None and second(2.0, 2.1) == 2  # two neighbours
    assert second(2.0, 0.0) is None            # a one-sample lull does not flap back
    assert second(1.0, 2.0) is None
    assert second(2.0, 0.0) is None and second(2.0, 0.0) == 4  # they left
    assert second(1.0, 9.0) is None and second(1.0, 9.0) == 1  # never below one thread
    assert second(1.0, 0.0) is None and second(1.0, 0.0) == 4
    clock.now += 5.0                           # an idle spell beside two neighbours that
    state["own"] += 10                         # have left by the next step: the long
    state["busy"] += 10 + 500 * 2              # sample's verdict is stale, 4 threads stay
    assert gov.update() is None and gov.threads == 4
    assert second(1.0, 0.0) is None and gov.threads == 4  # and nothing waits to flap
    clock.now += 5.0                           # the same, with them still running now:
    state["own"] += 10                         # one long sample is enough
    state["busy"] += 10 + 500 * 2
    state["running"] = 3
    assert gov.update() == 2
    single = ThreadGovernor(max_threads=1, cpus=frozenset({0}), clock=clock)
    assert single.update() is None
