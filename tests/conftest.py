"""Shared fixtures of the package's own tests: one warm pool per test process (an xdist worker), so
that no module pays again for the rank processes (spawn + ``import torch`` + rendezvous, seconds
each) another module already started; and, per module, the proof that every rank the pool ended
meanwhile (hung, crashed, evicted groups) is gone. When the session ends the pool is closed and
every rank it ever started must be gone."""

from __future__ import annotations

import os

import pytest

from dpfsdp_verify.config.defaults import EXPLORE_ENV
from dpfsdp_verify.gate import session as _gate_session
from dpfsdp_verify.harness import Pool, wait_gone

# the gate runs of these tests judge the fixed cases they count: no default exploration (an explicit
# --explore still explores; tests/fuzz/test_explore.py runs the default with the variable removed)
os.environ.setdefault(EXPLORE_ENV, "0")
# the gate runs made in this process run on the session's pool (verdict_helpers.run_gate): no zygotes
# are started ahead for the pool the CLI makes and they do not use (~3 s of CPU each); the console-script
# runs start theirs, as users' do (tests/gate/test_pipeline.py tests the early start itself)
_gate_session.EARLY_ZYGOTES = 0


@pytest.fixture(scope="session")
def _session_pool():
    p = Pool(max_groups=4)
    yield p
    p.close()
    assert wait_gone(p.started_pids) == [], "rank processes left behind"


class _ModuleView:
    """The session's pool as one module sees it: the same groups, plus a count of the jobs and
    groups the module asked for (what proves its tests ran something distributed)."""

    def __init__(self, pool: Pool):
        self._pool = pool
        self.used = 0

    def run(self, *args, **kwargs):
        self.used += 1
        return self._pool.run(*args, **kwargs)

    def group(self, *args, **kwargs):
        self.used += 1
        return self._pool.group(*args, **kwargs)

    def fresh_group(self, *args, **kwargs):
        self.used += 1
        return self._pool.fresh_group(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._pool, name)


@pytest.fixture(scope="module")
def pool(_session_pool):
    view = _ModuleView(_session_pool)
    yield view
    assert view.used, "the module ran no job on the pool: its tests ran nothing distributed"
    # the ranks still warm are the pool's; every other rank it started must be gone now
    live = set(_session_pool.pids())
    ended = [pid for pid in _session_pool.started_pids if pid not in live]
    assert wait_gone(ended) == [], "rank processes left behind"


#: Modules by measured cost, most expensive first, and the cheap ones run last: xdist (``--dist
#: worksteal``, pyproject.toml) then starts the longest work first and the two workers finish
#: together instead of one waiting on a long test the other picked up at the end. A scheduling
#: hint only; a module named in neither list runs between the two.
HEAVY_FIRST = ("test_plugin", "test_quiet", "test_packaging", "test_specimens", "test_noise_breadth",
               "test_properties_upstream", "test_cli", "test_finetune", "test_clip_breadth", "test_poisson",
               "test_timeouts", "test_harness", "test_accumulation", "test_reports", "test_expectations",
               "test_fuzz", "test_sampling_lags", "test_scale")
CHEAP_LAST = ("test_reference_layers", "test_strategies", "test_contract", "test_reference", "test_gather",
              "test_targets", "test_public_api", "test_proof")


def pytest_collection_modifyitems(config, items):
    order = {m: i for i, m in enumerate(HEAVY_FIRST)}
    order.update({m: len(HEAVY_FIRST) + 1 + i for i, m in enumerate(CHEAP_LAST)})
    middle = len(HEAVY_FIRST)
    items.sort(key=lambda item: order.get(item.path.stem, middle))  # stable: a module's own order is kept


@pytest.fixture(autouse=True)
def _verdict_words(monkeypatch):
    """Every verdict a test computes through ``properties.run`` -- every specimen the suite runs that
    way -- is checked for broken words (``verdict_helpers.verdict_word_problems``: an empty list, a
    doubled option in its replay line, "PRIVACY VIOLATION" said of a post-processing specimen); the
    test that computed it fails, naming the problem."""
    import dpfsdp_verify.properties as props
    from tests.verdict_helpers import verdict_word_problems

    run = props.run

    def checked(prop, target_ref, *args, **kwargs):
        verdicts = run(prop, target_ref, *args, **kwargs)
        bad = [(v.property, v.config, p) for v in verdicts for p in verdict_word_problems(v, target_ref)]
        assert not bad, f"broken verdict words for {target_ref}: {bad}"
        return verdicts

    monkeypatch.setattr(props, "run", checked)
