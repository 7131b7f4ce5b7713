"""A quiet terminal: the gate and the plugin print verdicts, not torch's flight-recorder analyser.

The analyser (``torch.distributed.flight_recorder.fr_trace``) logs its finding through its own
logger ("Not all ranks joining collective ...") and warns at import when ``tabulate`` is missing.
Its finding belongs in a hang verdict's details (JUnit text, the plugin's failure report), once;
never on stderr, and never again in pytest's "Captured log" / "Captured stderr" sections."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from tests.gate.test_cli import run_cli
from tests.plugin.test_plugin import tagged  # noqa: F401  (fixture: proves no rank outlives the run)

NOISE = ("Not all ranks joining", "tabulate is not installed", "Flight Recorder:")


@pytest.mark.slow
def test_gate_terminal_shows_the_hang_verdict_not_the_analyser(tmp_path):
    junit = tmp_path / "r.xml"
    res = run_cli("run", "--target", "fixtures.specimens:HookCollective", "--properties", "clipped_step",
                  "--world-sizes", "2", "--models", "mlp", "--loss-reductions", "mean", "--dtypes", "float64",
                  "--sampling", "fixed", "--wide-world-size", "0",
                  "--node-world-size", "0", "--horizon", "0", "--timeout", "20",
                  "--junit", str(junit))
    assert res.returncode == 1, res.stderr
    terminal = res.stdout + res.stderr
    assert "hang (deadlock)" in res.stderr and "clipped_step hang (deadlock)" in res.stdout  # the cause's block
    for noise in NOISE:
        assert noise not in terminal, f"{noise!r} reached the terminal:\n{terminal}"
    # the analyser's finding is still in the verdict's details (JUnit error text)
    (case,) = ET.parse(junit).getroot().iter("testcase")
    text = case.find("error").text
    assert "--- torch flight_recorder analyser (fr_trace) ---" in text
    finding = text.split("--- torch flight_recorder analyser (fr_trace) ---", 1)[1]
    assert "Collective sequence number: 5 has errors" in finding and "collective: gloo:all_gather" in finding


PLUGIN_HANG = '''
import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=2, timeout=10)
def test_hangs(rank):
    if rank == 0:
        dist.all_reduce(torch.ones(3))
'''


@pytest.mark.slow
def test_plugin_hang_report_carries_the_analyser_once(pytester, tagged):  # noqa: F811
    pytester.makepyfile(test_user=PLUGIN_HANG)
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    res.assert_outcomes(failed=1)
    full = res.stdout.str() + res.stderr.str()
    assert "HANG (deadlock) at world_size=2" in full
    # pytest itself repeats the whole failure message in its short summary when it runs on CI
    # (env CI or BUILD_NUMBER set); the report is judged in the failure's details, before that
    out = full.split("short test summary info", 1)[0]
    assert "HANG (deadlock) at world_size=2" in out
    # the finding is in the failure's details, after the analyser's header, and only there
    assert out.count("--- torch flight_recorder analyser (fr_trace) ---") == 1
    finding = out.split("--- torch flight_recorder analyser (fr_trace) ---", 1)[1]
    assert "Not all ranks joining collective, sequence number: " in finding and "missing ranks: {1}" in finding
    assert out.count("Not all ranks joining") == 1, out
    for noise in ("tabulate is not installed", "Flight Recorder:"):
        assert noise not in full, f"{noise!r} reached the terminal:\n{full}"
    assert "Captured log call" not in full and "Captured stderr call" not in full, full
