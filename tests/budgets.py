"""Time budgets: a test fails when it takes more CPU seconds than its budget (a pytest plugin; conftest.py loads it).

A test's seconds run from the start of its set-up to the end of its teardown: the user and system seconds of its
process and of every process under it (sweeps, notebook kernels, the book's build, the C++ compiler). CPU seconds,
not wall time: they hold on a 2-core machine that other work shares, where wall times grow 2-5x, and in any number
of pytest-xdist workers.

The budget: `@pytest.mark.budget(seconds)`, else SLOW_BUDGET_S for a test marked `slow`, else UNIT_BUDGET_S. A
fixture that several tests share (module or session scope) is charged to itself, not to the test that happens to
ask for it first: its budget is `shared_budget(seconds)` under its `@pytest.fixture`, else SLOW_BUDGET_S. The
budgets given are about twice what the tests took on the CI machine type (2 cores without AVX-512) from a fresh
clone, whose first imports compile their bytecode; the defaults are twice the most an ordinary test took there (a unit
test that starts a Python process with torch, 8-13 s; a slow test, up to 60 s). With `--durations`, the run ends with
the tests nearest their budgets.
"""

from __future__ import annotations

import resource

import psutil
import pytest

UNIT_BUDGET_S = 30
SLOW_BUDGET_S = 120


def shared_budget(seconds: float):
    """A shared fixture's budget of CPU seconds for its set-up (put it under `@pytest.fixture`)."""
    def mark(fixture_function):
        fixture_function.budget_s = seconds
        return fixture_function
    return mark


def cpu_seconds() -> float:
    """User + system seconds of this process, of its finished children (and theirs, once reaped), and of its
    live descendants with their finished children."""
    own, done = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    total = own.ru_utime + own.ru_stime + done.ru_utime + done.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:  # ended meanwhile: once reaped, its seconds are in its parent's
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def budget_of(item: pytest.Item) -> float:
    mark = item.get_closest_marker("budget")
    if mark is not None:
        return float(mark.args[0])
    return SLOW_BUDGET_S if item.get_closest_marker("slow") else UNIT_BUDGET_S


_started = pytest.StashKey[float]()  # CPU seconds when the test's set-up began
_shared = pytest.StashKey[float]()  # CPU seconds its shared fixtures' set-up took
_over = pytest.StashKey[bool]()  # failed for its budget already


def pytest_configure(config):
    config.addinivalue_line("markers", "budget(seconds): the test's CPU seconds, past which it fails "
                                       "(tests/budgets.py)")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_shared] = 0.0
    item.stash[_started] = cpu_seconds()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.scope == "function":
        return (yield)
    t0 = cpu_seconds()
    result = yield
    took = cpu_seconds() - t0  # its own: the fixtures it asks for are set up before this hook
    item = getattr(request, "_pyfuncitem", None)
    if item is not None and _shared in item.stash:
        item.stash[_shared] += took
    budget = getattr(fixturedef.func, "budget_s", SLOW_BUDGET_S)
    if took > budget:
        pytest.fail(f"fixture {fixturedef.argname!r} took {took:.1f} CPU seconds, over its budget of {budget:g} s: "
                    f"make it cheaper, or give it shared_budget(seconds) (tests/budgets.py)", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "setup" or _started not in item.stash:
        return report
    took = cpu_seconds() - item.stash[_started] - item.stash[_shared]
    budget = budget_of(item)
    if call.when == "teardown":
        report.user_properties += [("cpu_s", round(took, 2)), ("budget_s", budget)]
    if took > budget and report.passed and not item.stash.get(_over, False):
        item.stash[_over] = True
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {took:.1f} CPU seconds, over its budget of {budget:g} s: make it "
                           f"cheaper, or give it @pytest.mark.budget(seconds) (tests/budgets.py)")
    return report


_spent: list[tuple[float, float, str]] = []  # (CPU seconds, budget, test) of each test run


def pytest_runtest_logreport(report):
    props = dict(report.user_properties)
    if report.when == "teardown" and "cpu_s" in props:
        _spent.append((props["cpu_s"], props["budget_s"], report.nodeid))


def pytest_terminal_summary(terminalreporter, config):
    n = config.getoption("durations", None)
    if not _spent or n is None:
        return
    nearest = sorted(_spent, key=lambda s: s[0] / s[1], reverse=True)[:n or None]
    terminalreporter.write_sep("=", f"CPU seconds against budgets: the {len(nearest)} nearest theirs, of {len(_spent)} "
                                    f"tests ({sum(s for s, _, _ in _spent):.0f} s in all)")
    for spent, budget, nodeid in nearest:
        terminalreporter.write_line(f"{spent:7.1f} of {budget:5g} s  {nodeid}")
