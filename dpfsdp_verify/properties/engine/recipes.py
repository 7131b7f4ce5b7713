"""How a property is fuzzed and explored: the recipes a ``Property`` carries (``FuzzRecipe`` for
``--fuzz``, ``ExploreRecipe`` for ``--explore``), what a recipe's ``prepare`` returns, and the
keys an explored configuration drew; ``contract`` re-exports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple, Union

from ...targets import RunSpec

#: what ``FuzzRecipe.prepare`` returns: the spec to run, or the reason to skip it
Prepared = Union[RunSpec, str]


def unchanged(spec: RunSpec) -> Prepared:
    return spec


def explored_keys(spec: RunSpec) -> Dict[str, Any]:
    """What an explored configuration drew beyond the matrix's config keys (its ``config["explore"]``)."""
    out: Dict[str, Any] = {"global_batch_size": spec.global_batch_size, "steps": spec.steps, "lr": spec.lr,
                           "max_grad_norm": spec.max_grad_norm}
    if spec.resume_at:
        out["resume_at"] = spec.resume_at
    return out


@dataclass(frozen=True)
class ExploreRecipe:
    """How exploration (``--explore SECONDS``, docs/explore.md) draws a property's configurations
    from the configuration space (``dpfsdp_verify.config.space``): ``draw`` holds the keywords of
    ``strategies.explore_specs`` (which axes vary; the others stay at the space's defaults), and
    ``prepare(spec, knobs)`` turns a drawn spec and its knobs (e.g. ``clip_quantile``: where C sits
    among the reference norms) into the spec to run (a string: the reason it cannot run, a skip);
    ``labels(spec)`` gives the case's labels (e.g. ``horizon`` for a long run its judge judges
    step by step). The property's own ``judge`` judges it."""

    draw: Tuple[Tuple[str, Any], ...] = ()
    prepare: Callable[[RunSpec, Dict[str, Any]], Prepared] = lambda spec, knobs: spec
    labels: Callable[[RunSpec], Dict[str, Any]] = lambda spec: {}

    def draw_kwargs(self) -> Dict[str, Any]:
        return dict(self.draw)


@dataclass(frozen=True)
class FuzzRecipe:
    """How a property is fuzzed: each example is one ``RunSpec`` drawn from
    ``strategies.run_specs(world_size, **draw)`` (plus the fuzzer's models and grad_sample_mode),
    passed through ``prepare`` (e.g. the clip bound the property picks; a string is a skip
    reason), run once under the options' mode(s), and judged by the property's ``judge``."""

    draw: Tuple[Tuple[str, Any], ...] = ()
    prepare: Callable[[RunSpec], Prepared] = unchanged

    def draw_kwargs(self) -> Dict[str, Any]:
        return dict(self.draw)


__all__ = ["Prepared", "unchanged", "explored_keys", "ExploreRecipe", "FuzzRecipe"]
