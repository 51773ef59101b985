"""tools/test_budget.py: tests and seconds per module, and the total against the 12-minute budget."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tools import test_budget

ROOT = Path(__file__).resolve().parents[2]

DURATIONS = """\
============================= slowest durations ==============================
12.50s setup    tests/a/test_one.py::test_x
3.25s call     tests/a/test_one.py::test_y[2-optim]
0.25s teardown tests/a/test_one.py::test_y[2-optim]
4.00s call     tests/test_two.py::TestK::test_z
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
760 passed in 488.12s (0:08:08)
"""


def test_durations_and_junit_add_up_per_module(tmp_path):
    seconds, wall, closing = test_budget.durations_from_text(DURATIONS)
    assert seconds == {"tests/a/test_one.py": 16.0, "tests/test_two.py": 4.0}
    assert wall == 488.12 and closing == "760 passed"
    (tmp_path / "tests" / "a").mkdir(parents=True)
    (tmp_path / "tests" / "a" / "test_one.py").write_text("")
    (tmp_path / "tests" / "test_two.py").write_text("")
    (tmp_path / "junit.xml").write_text(textwrap.dedent("""\
        <testsuites><testsuite name="pytest" tests="3" time="20.5">
        <testcase classname="tests.a.test_one" name="test_x" time="12.5"/>
        <testcase classname="tests.a.test_one" name="test_y" time="3.5"/>
        <testcase classname="tests.test_two.TestK" name="test_z" time="4.0"/>
        </testsuite></testsuites>"""))
    seconds, wall, _ = test_budget.durations_from_junit(str(tmp_path / "junit.xml"), root=str(tmp_path))
    assert seconds == {"tests/a/test_one.py": 16.0, "tests/test_two.py": 4.0}  # a class's tests in its module
    assert wall == 20.5
    text = test_budget.table({"tests/a/test_one.py": 2, "tests/test_two.py": 1},
                             {"tests/a/test_one.py": 16.0, "tests/test_two.py": 4.0}, 800.0)
    lines = text.splitlines()
    assert lines[2].split() == ["tests/a/test_one.py", "2", "16.0", "80.0%"]
    assert lines[-2].split() == ["total", "3", "800.0"]
    assert lines[-1] == "budget: 800 s of 720 s (111%): OVER the budget"
    counts_only = test_budget.table({"tests/test_two.py": 1}, None, None)
    assert counts_only.splitlines()[-1].split() == ["total", "1", "-"] and "budget" not in counts_only


def test_run_counts_and_times_a_suite(tmp_path):
    """The tool on a suite of its own (its own pytest.ini: no ini or conftest of a directory above): counts,
    seconds, budget line."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_fast.py").write_text("import time\n\ndef test_a():\n    time.sleep(0.3)\n\n"
                                           "def test_b():\n    pass\n")
    (tmp_path / "test_other.py").write_text("import pytest\n\n@pytest.mark.parametrize('k', [1, 2, 3])\n"
                                            "def test_c(k):\n    pass\n")
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # a plain pytest: the installed plugins cost seconds
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "test_budget.py"), "--run", "-p", "no:cacheprovider",
                          "."], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[2].split()[:3] == ["test_fast.py", "2", "0.3"], out.stdout  # the slowest module first
    assert lines[3].split()[:2] == ["test_other.py", "3"], out.stdout
    assert lines[-2].startswith("budget: ") and lines[-2].endswith("within the budget") and "of 720 s" in lines[-2]
    assert lines[-1] == "pytest: 5 passed"
