"""The suite's time budgets (tests/budgets.py), on a suite of its own run in a subprocess: a test over its budget
fails naming it, one under passes; the seconds of the processes a test starts count; a shared fixture is charged
to itself, against its own budget; an unmarked test gets the unit or the slow default."""

from pathlib import Path

import budgets

SUITE = '''
import subprocess
import sys
import time

import pytest

from budgets import shared_budget


def burn(seconds):
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass


@pytest.fixture(scope="module")
@shared_budget(5)
def heavy():
    burn(0.5)


@pytest.fixture(scope="module")
@shared_budget(0.2)
def too_heavy():
    burn(0.5)


@pytest.mark.budget(5)
def test_under():
    burn(0.3)


@pytest.mark.budget(0.2)
def test_over():
    burn(0.5)


@pytest.mark.budget(0.2)
def test_over_in_a_child():
    subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\n"
                    "while time.process_time() - t < 0.6: pass"], check=True)


@pytest.mark.budget(0.2)
def test_with_a_heavy_shared_fixture(heavy):
    pass


def test_with_a_fixture_over_its_budget(too_heavy):
    pass


def test_unit():
    pass


@pytest.mark.slow
def test_slow():
    pass
'''


def test_budgets_fail_what_runs_over_and_pass_the_rest(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(budgets.__file__).parent))
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess("-p", "budgets", "-p", "no:cacheprovider", "--durations=0")
    result.assert_outcomes(passed=4, failed=2, errors=1)  # passed: under, heavy shared fixture, unit, slow
    out = result.stdout.str()
    for name in ("test_over", "test_over_in_a_child"):
        assert f"test_suite.py::{name} took " in out and "over its budget of 0.2 s" in out, out
    assert "fixture 'too_heavy' took " in out and "over its budget of 0.2 s" in out, out
    summary = out[out.index("CPU seconds against budgets"):]
    assert f"of {budgets.UNIT_BUDGET_S:5g} s  test_suite.py::test_unit" in summary, summary
    assert f"of {budgets.SLOW_BUDGET_S:5g} s  test_suite.py::test_slow" in summary, summary
