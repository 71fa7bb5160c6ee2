"""tests/launching.py: a test that starts two or more processes must be marked ``launch``, so that the README's
command (which leaves those out) cannot quietly grow a multi-process launch."""

import pathlib
import re
import sys

from tests import launching
import pytest

TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_an_unmarked_test_is_refused_two_processes_before_anything_starts(tmp_path, request):
    started = tmp_path / "started"
    command = [sys.executable, "-c", f"open({str(started)!r}, 'w')"]
    with pytest.raises(launching.UnmarkedLaunch) as refused:
        launching.run_launch(command, processes=2, timeout=60)
    with pytest.raises(launching.UnmarkedLaunch):
        launching.start_launch(command, processes=2)
    message = str(refused.value)
    assert request.node.nodeid in message and "starts 2 processes" in message
    assert "@pytest.mark.launch" in message and "-m launch" in message
    assert not started.exists()


def test_an_unmarked_test_runs_one_process(tmp_path):
    started = tmp_path / "started"
    result = launching.run_launch([sys.executable, "-c", f"open({str(started)!r}, 'w')"], processes=1, timeout=60)
    assert result.returncode == 0 and started.exists()


@pytest.fixture
def test_seen_by_a_fixture():
    return launching._running_test


def test_the_marker_is_read_from_the_running_test(request, test_seen_by_a_fixture):
    """tests/conftest.py names the running test to tests/launching.py before its fixtures are set up: a fixture
    that launches (conftest's zero2_quickstart_run) is checked against the test that asked for it."""
    assert test_seen_by_a_fixture is request.node
    assert launching._running_test is request.node
    with pytest.raises(launching.UnmarkedLaunch):
        launching.refuse_unless_marked(2, ["accelerate", "launch"])
    request.node.add_marker(pytest.mark.launch)
    launching.refuse_unless_marked(2, ["accelerate", "launch"])  # marked: allowed


# How a test starts processes; only tests/launching.py and its process helpers (tests/side_by_side.py) may.
STARTS_PROCESSES = re.compile(r"accelerate\.commands\.launch|\bPopen\(|\bspawn\(|\btorchrun\b")


def test_every_launch_in_the_tests_goes_through_the_launching_helper():
    found = [f"{path.relative_to(TESTS)}:{number}: {line.strip()}"
             for path in sorted(TESTS.rglob("*.py")) if path.name not in ("launching.py", "side_by_side.py")
             and path != pathlib.Path(__file__).resolve()
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if STARTS_PROCESSES.search(line) and not line.lstrip().startswith("#")]
    assert not found, "start processes through tests/launching.py (it checks the launch marker):\n" + "\n".join(found)
