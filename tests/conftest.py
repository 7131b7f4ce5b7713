"""Shared fixture of the package's own tests: a module-scoped warm pool that proves, when the
module is done, that every rank it ever started (hung and crashed groups included) is gone."""

from __future__ import annotations

import pytest

from dpfsdp_verify.harness import Pool, wait_gone


@pytest.fixture(scope="module")
def pool():
    p = Pool(max_groups=4)
    yield p
    p.close()
    assert p.started_pids, "the module started no ranks: its tests ran nothing distributed"
    assert wait_gone(p.started_pids) == [], "rank processes left behind"
