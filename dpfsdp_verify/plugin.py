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
  once, runs distributed tests collectively in-process, skips those that need another world size,
  and lets only rank 0 write reports (terminal summary, JUnit XML).

Fixtures: ``rank`` and ``world_size`` (the values on the rank running the body; in the parent
process of pool mode ``rank`` is ``None``). Other fixture values a distributed test requests
must be picklable: they are computed in the parent and sent to every rank.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Optional

import pytest

from .harness import BackendUnavailable, GroupStartError, JobPicklingError, Pool
from .harness.pool import DEFAULT_TIMEOUT_S

MARKER_HELP = (
    "distributed(world_size=2, backend='gloo', timeout=None, env=None): run the test body on every rank of a "
    "worker group with torch.distributed initialised. world_size: number of ranks. backend: 'gloo' (CPU) or "
    "'nccl' (one GPU per rank; skipped with a reason when there are not enough GPUs). timeout: seconds before "
    "the run is declared a hang and diagnosed (default: --dpfsdp-timeout). env: dict of environment variables "
    "the ranks are started with (a separate warm group per distinct env)."
)

_pool: Optional[Pool] = None


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


def torchrun_env() -> Optional[tuple]:
    """``(rank, world_size)`` when this process is a torchrun rank, else ``None``."""
    if all(v in os.environ for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", MARKER_HELP)
    _hypothesis_configure(config)
    tr = torchrun_env()
    if tr is not None:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dist.init_process_group(backend)
        if tr[0] != 0:
            config.option.xmlpath = None  # only rank 0 writes the JUnit report


def pytest_unconfigure(config):
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None
    if torchrun_env() is not None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _get_pool(config) -> Pool:
    global _pool
    if _pool is None:
        _pool = Pool(reuse=not config.getoption("dpfsdp_fresh"))
    return _pool


MARKER_KWARGS = ("world_size", "backend", "timeout", "env")


def _marker_args(item):
    """``(world_size, backend, timeout, env)`` of the item's marker; a misspelt or mistyped
    argument fails the test with a one-line reason instead of silently running something else."""
    m = item.get_closest_marker("distributed")
    kw = dict(m.kwargs)
    unknown = sorted(set(kw) - set(MARKER_KWARGS))
    if unknown:
        pytest.fail(f"@pytest.mark.distributed: unknown argument(s) {', '.join(unknown)}; "
                    f"accepted: {', '.join(MARKER_KWARGS)}", pytrace=False)
    if len(m.args) > 1:
        pytest.fail("@pytest.mark.distributed takes at most one positional argument (world_size)", pytrace=False)
    if m.args:
        kw.setdefault("world_size", m.args[0])
    try:
        world_size = int(kw.get("world_size", 2))
        backend = kw.get("backend", "gloo")
        timeout = kw.get("timeout")
        if timeout is None:
            opt = item.config.getoption("dpfsdp_timeout")
            timeout = opt if opt is not None else float(item.config.getini("dpfsdp_timeout"))
        timeout = float(timeout)
        env = {str(k): str(v) for k, v in dict(kw.get("env") or {}).items()}
    except (TypeError, ValueError) as e:
        world_size, timeout, problem = 0, 0.0, str(e)
    else:
        problem = None
    if problem:
        pytest.fail(f"@pytest.mark.distributed: bad argument ({problem}); expected world_size=int, "
                    "timeout=seconds, env={VAR: value}", pytrace=False)
    if timeout <= 0:
        pytest.fail(f"@pytest.mark.distributed: timeout must be > 0 seconds, got {timeout:g}", pytrace=False)
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
    return int(m.kwargs.get("world_size", m.args[0] if m.args else 2))


@pytest.fixture
def rank():
    """This rank's index; ``None`` in the parent process (the body never runs there)."""
    tr = torchrun_env()
    return tr[0] if tr is not None else None


@dataclass(frozen=True)
class FunctionRef:
    """A test function by location, resolvable on a rank whatever pytest's import mode was."""

    module: str
    path: str
    qualname: str

    def resolve(self):
        mod = sys.modules.get(self.module)
        if mod is None:
            try:
                mod = importlib.import_module(self.module)
            except ImportError:
                spec = importlib.util.spec_from_file_location(self.module, self.path)
                mod = importlib.util.module_from_spec(spec)
                sys.modules[self.module] = mod
                spec.loader.exec_module(mod)
        obj = mod
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return getattr(obj, "__func__", obj)


def run_test_body(ref: FunctionRef, kwargs: dict, cls_ref: Optional[FunctionRef] = None):
    """Rank-side job: call the test function with this rank's ``rank``/``world_size``."""
    import torch.distributed as dist

    fn = ref.resolve()
    call = dict(kwargs)
    if "rank" in call:
        call["rank"] = dist.get_rank()
    if "world_size" in call:
        call["world_size"] = dist.get_world_size()
    if cls_ref is not None:
        return fn(cls_ref.resolve()(), **call)
    return fn(**call)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("distributed") is None:
        return None
    world, backend, timeout, env = _marker_args(pyfuncitem)
    tr = torchrun_env()
    if tr is not None:
        return _run_collectively(pyfuncitem, world, tr)
    fn = pyfuncitem.obj
    argnames = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in argnames}
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
    if result.status == "hang":
        pytest.fail(f"HANG (deadlock) at world_size={world}: {result.message}\n\n{result.details}", pytrace=False)
    if not result.ok:
        pytest.fail(f"{result.message}\n\n{result.details}", pytrace=False)
    return True


def _run_collectively(item, world: int, tr) -> bool:
    """torchrun mode: run the body here, on every rank at once, and agree on the outcome."""
    import torch.distributed as dist

    if world != tr[1]:
        pytest.skip(f"needs world_size={world}; this torchrun job has {tr[1]} ranks")
    argnames = item._fixtureinfo.argnames
    kwargs = {name: item.funcargs[name] for name in argnames}
    error = None
    try:
        item.obj(**kwargs)
    except BaseException as e:  # noqa: B902 - reported collectively below
        error = f"rank {tr[0]}: {type(e).__name__}: {e}"
    errors = [None] * tr[1]
    dist.all_gather_object(errors, error)
    failed = [e for e in errors if e]
    if failed:
        pytest.fail("; ".join(failed), pytrace=False)
    return True


# -- hypothesis profiles for fuzzing (dpfsdp_verify.hypothesis_profiles) -----------------------
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
    from .hypothesis_profiles import PROFILE_ENV, load_profile, register_profiles

    name = config.getoption("dpfsdp_hypothesis_profile", None) or os.environ.get(PROFILE_ENV)
    register_profiles(str(config.rootpath))
    if name:
        try:
            load_profile(name, str(config.rootpath))
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
