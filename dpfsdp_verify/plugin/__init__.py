"""pytest plugin: ``@pytest.mark.distributed`` runs a test body on every rank of a worker group.

Wiring only (options, marker, hooks); the work is the harness' (``dpfsdp_verify.harness``).

Two ways a distributed test runs:

* **pool mode** (default, plain ``pytest`` or ``pytest -n N``): the body is shipped to a warm
  worker group of the marker's ``world_size`` from this pytest process' pool (one pool per xdist
  worker; rendezvous through a private FileStore, so no port can collide). A failure on any rank
  fails the test naming the rank and showing its traceback; a hang fails it with the diagnosis
  (which rank is in which collective, stacks); the group is replaced and the session goes on.
* **torchrun mode** (``torchrun --nproc-per-node N -m pytest ...``): the plugin sees it already
  is a rank (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set by torchrun), initialises the process group
  with the deadline as its timeout, runs distributed tests collectively in-process, agrees on each
  outcome through the store (``harness/torchrun.py``), skips those that need another world size, and
  lets only rank 0 report (terminal output, JUnit XML).

Deadlines: the marker's ``timeout=`` (else ``--dpfsdp-timeout`` / ini ``dpfsdp_timeout``). When
pytest-timeout also limits the test to T seconds and the deadline is not below T, the deadline
becomes T minus a margin (``timeout_margin``), so that the plugin's diagnosed verdict arrives
before pytest-timeout interrupts the test; if pytest-timeout interrupts a run anyway, the group is
ended and replaced, and the next test is unaffected.

Fixtures: ``rank`` and ``world_size`` (the values on the rank running the body; in the parent
process of pool mode ``rank`` is ``None``). Other fixture values a distributed test requests
must be picklable: they are computed in the parent and sent to every rank. ``world_size=[1, 2]``
makes one test item per size (ids ``[ws1]``, ``[ws2]``). Each rank's output of a pool-mode test is
attached to its report (sections ``rank R stdout`` / ``rank R stderr``); test modules are
imported on the ranks with pytest's assertion rewriting.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, cast

import pytest

from ..harness import BackendUnavailable, GroupStartError, JobPicklingError, Pool
from ..harness.pool import DEFAULT_TIMEOUT_S
from .testbody import FunctionRef, run_test_body  # noqa: F401 - run_test_body: the job ranks import
from ..harness.torchrun import TorchrunSession, torchrun_env

MARKER_HELP = (
    "distributed(world_size=2, backend='gloo', timeout=None, env=None): run the test body on every rank of a "
    "worker group with torch.distributed initialised. world_size: number of ranks, or a list of them (one test "
    "per size, ids [ws1], [ws2]...). backend: 'gloo' (CPU) or "
    "'nccl' (one GPU per rank; skipped with a reason when there are not enough GPUs). timeout: seconds before "
    "the run is declared a hang and diagnosed (default: --dpfsdp-timeout). env: dict of environment variables "
    "the ranks are started with (a separate warm group per distinct env)."
)

_pool: Optional[Pool] = None
_torchrun: Optional[TorchrunSession] = None
#: Hidden parameter carrying one size of ``world_size=[...]``.
WS_PARAM = "_dpfsdp_world_size"


def pytest_addoption(parser):
    group = parser.getgroup("dpfsdp-verify", "distributed DP tests (dpfsdp-verify)")
    group.addoption(
        "--dpfsdp-timeout", type=float, default=None, dest="dpfsdp_timeout",
        help="Deadline in seconds for one distributed test before it is declared a hang: every rank's "
             "stacks and flight-recorder collective trace are collected, the group is killed and the test "
             f"fails with the diagnosis. Overrides the ini value dpfsdp_timeout (default {DEFAULT_TIMEOUT_S:g}); "
             "a marker's timeout= overrides both.")
    group.addoption(
        "--dpfsdp-fresh-groups", action="store_true", default=False, dest="dpfsdp_fresh",
        help="Start a fresh worker group for every distributed test instead of reusing warm ones "
             "(slower by seconds per test; for isolating a suspected state leak).")
    parser.addini("dpfsdp_timeout", f"default deadline (s) of a distributed test (default {DEFAULT_TIMEOUT_S:g})",
                  default=str(DEFAULT_TIMEOUT_S))
    _hypothesis_addoption(group)


def _default_timeout(config) -> float:
    opt = config.getoption("dpfsdp_timeout")
    return float(opt if opt is not None else config.getini("dpfsdp_timeout"))


def pytest_configure(config):
    global _torchrun
    config.addinivalue_line("markers", MARKER_HELP)
    _hypothesis_configure(config)
    tr = torchrun_env()
    if tr is not None and _torchrun is None:
        _torchrun = TorchrunSession(tr[0], tr[1], timeout=_default_timeout(config))
        if tr[0] != 0:
            config.option.xmlpath = None  # only rank 0 writes the JUnit report


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """torchrun mode: only rank 0 reports; the other ranks' terminal reporter writes nowhere
    (replacing its writer, not unregistering it: other plugins ask for it)."""
    tr = torchrun_env()
    if tr is None or tr[0] == 0:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        from _pytest._io import TerminalWriter

        devnull = open(os.devnull, "w")
        session.config.add_cleanup(devnull.close)
        reporter._tw = TerminalWriter(devnull)


def pytest_unconfigure(config):
    global _pool, _torchrun
    if _pool is not None:
        _pool.close()
        _pool = None
    if _torchrun is not None:
        _torchrun.close()
        _torchrun = None


def _get_pool(config) -> Pool:
    global _pool
    if _pool is None:
        _pool = Pool(reuse=not config.getoption("dpfsdp_fresh"))
    return _pool


MARKER_KWARGS = ("world_size", "backend", "timeout", "env")


def _raw_world_size(marker):
    return marker.kwargs.get("world_size", marker.args[0] if marker.args else 2)


def pytest_generate_tests(metafunc):
    """``world_size=[1, 2]``: one item per size, through a hidden parameter."""
    m = metafunc.definition.get_closest_marker("distributed")
    if m is None:
        return
    sizes = _raw_world_size(m)
    if isinstance(sizes, (list, tuple)):
        metafunc.fixturenames.append(WS_PARAM)
        metafunc.parametrize(WS_PARAM, list(sizes), ids=[f"ws{w}" for w in sizes])


@pytest.fixture
def _dpfsdp_world_size(request):
    """One size of a marker's ``world_size=[...]`` (a hidden parameter, see pytest_generate_tests)."""
    return request.param


def _item_world_size(item, marker):
    callspec = getattr(item, "callspec", None)
    if callspec is not None and WS_PARAM in callspec.params:
        return callspec.params[WS_PARAM]
    return _raw_world_size(marker)


def timeout_margin(t: float) -> float:
    """How far below pytest-timeout's ``t`` seconds the plugin's deadline is put: time for the
    dump, the diagnosis and the teardown (~0.1-0.5 s on 2 cores) with room to spare."""
    return min(5.0, 0.25 * t)


def outer_timeout_of(item) -> Optional[float]:
    """pytest-timeout's effective timeout for ``item`` in seconds (its marker, ini or option), or
    ``None`` when pytest-timeout is not installed or sets none."""
    if not item.config.pluginmanager.hasplugin("timeout"):
        return None
    try:
        from pytest_timeout import _get_item_settings

        t = _get_item_settings(item).timeout
    except Exception:  # a private helper of pytest-timeout: if it changes, no clamping
        return None
    return float(t) if t else None


def _marker_args(item):
    """``(world_size, backend, timeout, env)`` of the item's marker; a misspelt or mistyped
    argument fails the test with a one-line reason instead of silently running something else.
    ``timeout`` is kept below pytest-timeout's (see ``timeout_margin``)."""
    m = item.get_closest_marker("distributed")
    kw = dict(m.kwargs)
    unknown = sorted(set(kw) - set(MARKER_KWARGS))
    if unknown:
        pytest.fail(f"@pytest.mark.distributed: unknown argument(s) {', '.join(unknown)}; "
                    f"accepted: {', '.join(MARKER_KWARGS)}", pytrace=False)
    if len(m.args) > 1:
        pytest.fail("@pytest.mark.distributed takes at most one positional argument (world_size)", pytrace=False)
    problem: Optional[str]
    try:
        world_size = int(_item_world_size(item, m))
        backend = kw.get("backend", "gloo")
        timeout = kw.get("timeout")
        timeout = float(timeout if timeout is not None else _default_timeout(item.config))
        env = {str(k): str(v) for k, v in dict(kw.get("env") or {}).items()}
    except (TypeError, ValueError) as e:
        world_size, timeout, problem = 0, 0.0, str(e)
    else:
        problem = None
    if problem:
        pytest.fail(f"@pytest.mark.distributed: bad argument ({problem}); expected world_size=int or a list of "
                    "ints, timeout=seconds, env={VAR: value}", pytrace=False)
    if timeout <= 0:
        pytest.fail(f"@pytest.mark.distributed: timeout must be > 0 seconds, got {timeout:g}", pytrace=False)
    outer = outer_timeout_of(item)
    if outer is not None and timeout >= outer:
        timeout = outer - timeout_margin(outer)
    return world_size, backend, timeout, env


@pytest.fixture
def world_size(request):
    """Number of ranks of the distributed test (from its marker, or torchrun's WORLD_SIZE)."""
    tr = torchrun_env()
    if tr is not None:
        return tr[1]
    m = request.node.get_closest_marker("distributed")
    if m is None:
        return 1
    return int(_item_world_size(request.node, m))


@pytest.fixture
def rank():
    """This rank's index; ``None`` in the parent process (the body never runs there)."""
    tr = torchrun_env()
    return tr[0] if tr is not None else None


GIVEN_REFUSED = ("@given cannot drive a @pytest.mark.distributed test (each example would have to be a job on "
                 "the ranks); run the examples on the group from a plain test instead, e.g. "
                 "dpfsdp_verify.fuzz.fuzz_property(...) or pool.run(job, example) inside your own @given test")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Refuse ``@given`` + ``@pytest.mark.distributed`` before hypothesis or the ranks see it."""
    if item.get_closest_marker("distributed") is not None and getattr(getattr(item, "obj", None),
                                                                      "is_hypothesis_test", False):
        pytest.fail(GIVEN_REFUSED, pytrace=False)


def _test_kwargs(item) -> dict:
    return {name: item.funcargs[name] for name in item._fixtureinfo.argnames if name != WS_PARAM}


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("distributed") is None:
        return None
    world, backend, timeout, env = _marker_args(pyfuncitem)
    if _torchrun is not None:
        return _run_collectively(pyfuncitem, world, timeout)
    fn = pyfuncitem.obj
    kwargs = _test_kwargs(pyfuncitem)
    mod = sys.modules[fn.__module__]
    ref = FunctionRef(fn.__module__, getattr(mod, "__file__", "") or "", fn.__qualname__)
    cls_ref = None
    if pyfuncitem.cls is not None:
        cls_ref = FunctionRef(fn.__module__, ref.path, pyfuncitem.cls.__qualname__)
    problem = None
    try:
        result = _get_pool(pyfuncitem.config).run(run_test_body, ref, kwargs, cls_ref, world_size=world,
                                                   backend=backend, env=env, timeout=timeout)
    except BackendUnavailable as e:
        pytest.skip(str(e))
    except (JobPicklingError, GroupStartError, ValueError) as e:
        problem = f"distributed test could not be started: {e}"
    if problem:  # failed outside the except block: no chained torch/pickle traceback
        pytest.fail(problem, pytrace=False)
    for r, res in sorted(result.results.items()):
        for stream in ("stdout", "stderr"):
            text = getattr(res, stream, "")
            if text:
                pyfuncitem.add_report_section("call", f"rank {r} {stream}", text)
    if result.status == "hang":
        pytest.fail(f"HANG ({result.diagnosis}) at world_size={world}: {result.message}\n\n{result.details}",
                    pytrace=False)
    if not result.ok:
        pytest.fail(f"{result.message}\n\n{result.details}", pytrace=False)
    return True


def _run_collectively(item, world: int, timeout: float) -> bool:
    """torchrun mode: run the body here, on every rank at once, and agree on the outcome
    through the store (``harness.torchrun.TorchrunSession.run_test``)."""
    session = cast(TorchrunSession, _torchrun)  # called only while the plugin holds a session
    if world != session.world_size:
        pytest.skip(f"needs world_size={world}; this torchrun job has {session.world_size} ranks")
    kwargs = _test_kwargs(item)
    failure = session.run_test(item.nodeid, lambda: item.obj(**kwargs), timeout)
    if failure is None:
        return True
    if failure.startswith("skip: "):
        pytest.skip(failure[len("skip: "):])
    pytest.fail(failure, pytrace=False)


# -- hypothesis profiles for fuzzing (dpfsdp_verify.config.hypothesis_profiles) -----------------------
def _hypothesis_addoption(group) -> None:
    group.addoption(
        "--dpfsdp-hypothesis-profile", default=None, dest="dpfsdp_hypothesis_profile",
        choices=("ci", "dev", "nightly"),
        help="Hypothesis settings profile for the DP-FSDP fuzz strategies and drivers: 'ci' (deterministic, "
             "10 examples, no database), 'dev' (random, 25, database), 'nightly' (random, 500, database). "
             "Loaded as hypothesis' default for the session. Default: $DPFSDP_HYPOTHESIS_PROFILE; if neither is "
             "set, hypothesis' own settings are left alone. The database lives in "
             "<rootdir>/.hypothesis/dpfsdp-examples.")


def _hypothesis_configure(config) -> None:
    from ..config.hypothesis_profiles import PROFILE_ENV, load_profile, register_profiles

    name = config.getoption("dpfsdp_hypothesis_profile", None) or os.environ.get(PROFILE_ENV)
    register_profiles(str(config.rootpath))
    if name:
        try:
            load_profile(name, str(config.rootpath))
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None


__all__ = ["MARKER_HELP", "WS_PARAM", "pytest_addoption", "pytest_configure", "pytest_sessionstart",
           "pytest_unconfigure", "MARKER_KWARGS", "pytest_generate_tests", "timeout_margin", "outer_timeout_of",
           "world_size", "rank", "GIVEN_REFUSED", "pytest_runtest_setup", "pytest_pyfunc_call"]
