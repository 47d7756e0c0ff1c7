"""The suite's CI rules (tests/conftest.py): under CI=true a skip for a missing compiler, g++,
cmake or the emulator fails the run, other skips (hardware features) stay skips, and the run
ends with the skip count and its reasons."""
import os

import pytest

pytest_plugins = ["pytester"]

TESTS = '''
import pytest

def test_needs_a_compiler():
    pytest.skip("no C++ compiler here")

@pytest.mark.skipif(True, reason="the AscendC emulator needs g++")
def test_needs_gxx():
    pass

def test_needs_amx():
    pytest.skip("no AMX on this CPU")

@pytest.mark.xfail(reason="a known gap")
def test_known_gap():
    assert False
'''


@pytest.mark.parametrize("ci", ["true", ""])
def test_a_skip_for_a_missing_tool_fails_under_ci(pytester, monkeypatch, ci):
    pytester.makeconftest(open(os.path.join(os.path.dirname(__file__), "conftest.py")).read())
    pytester.makepyfile(test_rules=TESTS)
    monkeypatch.setenv("CI", ci)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    if ci:
        result.assert_outcomes(failed=1, errors=1, skipped=1, xfailed=1)  # a setup-phase skip fails as an error
        result.stdout.fnmatch_lines(["*CI=true: a skip for a missing tool fails the suite*"])
    else:
        result.assert_outcomes(skipped=3, xfailed=1)
    result.stdout.fnmatch_lines(["*skipped:", "*no AMX on this CPU"])
