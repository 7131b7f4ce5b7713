"""Fuzzing from Python (the ``fuzz`` extra): any property with a fuzz recipe on hypothesis-drawn
``RunSpec``s, one spec per example, each a job on an already running worker group judged by the
property's own ``judge`` against the float64 reference. ``search.py`` says how examples are drawn,
shrunk and reported, ``strategies.py`` what they are drawn from; this module takes property ids
and keywords, and runs the search with the runner's ``check_example``::

    from dpfsdp_verify import fuzz
    verdicts = fuzz.fuzz_property(property_id, "opacus", 20, world_sizes=(1, 2))
    for v in verdicts:
        if v.status != "pass":
            print(fuzz.format_failure(v))   # minimal spec, seed, blob, replay line

From the command line: ``dpfsdp-verify run --properties P --fuzz N``, and ``dpfsdp-verify replay``
for the ``repro`` line of a failure.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

from ..config import modes as modes_mod
from ..harness import JobPool, Pool
from ..config.modes import Mode
from ..properties import PROPERTIES, Property, fuzzable
from ..properties.engine import runner
from ..properties.engine.contract import Case, Options
from ..properties.engine.session import Session
from ..targets import RunSpec
from ..verdict import Verdict
from .search import DEFAULT_DTYPES, DEFAULT_MODELS, Counterexample, format_failure, fuzz_groups

#: modes as the Python API gives them (``{label: {VAR: value}}``) or as ``Mode``s
ModesLike = Union[dict, Sequence[Mode]]


def fuzzable_property(property_id: str) -> Property:
    """The property ``property_id`` if it has a fuzz recipe; ``ValueError`` naming the ones that do."""
    prop = PROPERTIES.get(property_id)
    if prop is None or prop.fuzz is None:
        raise ValueError(f"property {property_id!r} cannot be fuzzed; choose one of {', '.join(fuzzable())}")
    return prop


def fuzz_property(property_id: str, target_ref: str, n_examples: int, *, pool: Optional[JobPool] = None,
                  settings=None, **options) -> List[Verdict]:
    """``n_examples`` examples at each world size and mode group, one verdict each. ``options`` are
    a property call's keywords (``world_sizes``, ``modes``, ``models``, ``dtypes``,
    ``grad_sample_mode``, ``backend``, ``timeout``, ``seed`` -- the hypothesis seed; ``TypeError``
    for one the property does not know); ``settings`` overrides the hypothesis profile's;
    ``pool=None`` uses a private pool. ``ValueError`` for a property that cannot be fuzzed."""
    prop = fuzzable_property(property_id)
    return fuzz_examples(prop, prop.options(target_ref, **options), n_examples, pool, settings)


def fuzz_examples(prop: Property, opts: Options, n_examples: int, pool: Optional[JobPool] = None,
                  settings=None, session: Optional[Session] = None) -> List[Verdict]:
    """``n_examples`` hypothesis-drawn examples of ``prop`` (it must have a ``fuzz`` recipe) at each
    of the options' world sizes and mode groups, each run and judged by ``runner.check_example``
    (``search.fuzz_groups``); ``settings`` overrides the hypothesis profile's. ``pool=None``: a
    private pool, closed at the end; ``session``: the run's ledger and listener (``engine/session.py``).
    What ``dpfsdp-verify run --fuzz N`` hands the runner."""
    opts = prop.with_defaults(opts)
    own = pool is None
    pool = pool or Pool()
    try:
        def check(spec, world_size, modes):
            return runner.check_example(prop, opts, spec, world_size, pool, modes, session)

        return fuzz_groups(prop, opts, n_examples, check, settings)
    finally:
        if own:
            pool.close()


def check_example(property_id: str, opts: Options, spec: RunSpec, world_size: int, *, pool: JobPool,
                  modes: Sequence[Mode] = ()) -> Verdict:
    """The property's verdict for one spec at one world size (what ``dpfsdp-verify replay`` runs)."""
    return runner.check_example(fuzzable_property(property_id), opts, spec, world_size, pool, modes)


def spec_to_json(spec: RunSpec) -> str:
    return spec.to_json()


def spec_from_json(text: str) -> RunSpec:
    return RunSpec.from_json(text)


def replay_command(property_id: str, target_ref: str, spec: RunSpec, world_size: int,
                   modes: ModesLike, backend: str = "gloo") -> str:
    """One shell line that re-runs exactly this spec (``dpfsdp-verify replay``)."""
    return Case(property_id, target_ref, spec, world_size, modes_mod.from_mapping(modes), backend=backend,
                drawn=spec).repro()


__all__ = ["fuzz_property", "fuzz_examples", "check_example", "fuzzable_property", "spec_to_json", "spec_from_json",
           "replay_command", "format_failure", "Counterexample", "DEFAULT_MODELS", "DEFAULT_DTYPES"]
