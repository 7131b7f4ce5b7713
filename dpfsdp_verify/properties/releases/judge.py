"""The whole-run release judge: every noisy run a gate run makes, whichever property made it, is
evidence for ``noise_calibration`` at every step and rank (``releases/analysis.py`` decomposes and
tests, ``releases/wording.py`` words).

How it is fed: ``runner.judge_case`` hands every case whose runs passed the runner's prechecks to the
ledger of the run's session (``engine/session.py``) before the owning property judges it; the ledger
keeps only the small per-(step, rank) statistics of each noisy run, never its tensors. The gate's
session holds a ledger for its whole run when ``noise_calibration`` is selected (``gate/session.py``);
anything else that judges cases with that session (the fuzzer, an exploration) feeds the same ledger.

What it gives (``Ledger.verdicts``), all ``noise_calibration`` verdicts with config key ``releases``:

* per run with a finding (``releases`` = the property that made the run, plus that case's config): a
  ``fail`` naming the step(s), rank(s), dtype, lr and loop shape (diagnosis ``mismatch`` for a scale
  or a mean, ``non_gaussian_noise`` for a value grid, ``dependent_noise`` for a repeat); its repro
  line re-runs the owning property with ``noise_calibration``;
* a pooled scale failure no single run shows (``releases = "pooled"``);
* otherwise one ``pass`` (``releases = "every run"``) saying how many runs, steps and shards were
  judged and the power;
* ``error`` / ``internal_error`` if decomposing a run raised (a bug here, exit 3).

False alarm: the statistical tests of one gate run share ``ALPHA`` (Bonferroni over every run's
scale, per-step, per-rank and mean tests and the pooled groups): a correct target fails a gate
run's release verdicts with probability <= ``ALPHA``; the exact checks (grid, repeats) have
false-alarm probabilities below 1e-20 each.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import asdict, replace
from typing import Dict, List, Tuple

from ...lazy import torch

from ...verdict import INTERNAL_ERROR, Verdict, config_label
from .analysis import (RunReleases, contrasts, decompose, detectable_ratio, pooled_groups, pooled_tests,
                                 run_tests, tests_of)
from .wording import judged_message, pass_message, pooled_message, where
from ..analysis.compare import flat
from ..analysis.postprocessing import PostProcessing, coarse_grid, noisy_finding, pinned, release_norms
from . import signal
from ..wording.postprocessing import DIAGNOSIS as POST_PROCESSED, post_processing_message, rounded_grid_message
from ..engine.contract import Case, Options, Outputs
from ..engine.prechecks import device_facts
from ..engine.threads import one_thread

#: the property whose verdicts the ledger gives
PROPERTY_ID = "noise_calibration"
#: false-alarm probability of one gate run's release verdicts (module docstring)
ALPHA = 1e-4
#: a case fact (``facts[SKIP_FACT] = reason``): its runs are left out of this judge, and the same runs made for
#: another property too, for the reason given -- a property that reads its release its own way and whose run
#: the judge's tests would only cost time on (``releases_judged`` says "my property judges these releases
#: with the judge's own tests", which such a property does not)
SKIP_FACT = "releases_skip"
DIAGNOSIS = {"coarse": "non_gaussian_noise", "silent": "mismatch", "scale": "mismatch", "mean": "mismatch",
             "grid": "non_gaussian_noise", "repeat": "dependent_noise"}



class Ledger:
    """The noisy runs of one gate run (module docstring)."""

    def __init__(self) -> None:
        self.runs: List[Tuple[Case, RunReleases]] = []
        self.errors: List[Tuple[Case, str, str]] = []
        #: where each judged case's ranks computed (``prechecks.device_facts``), by ``id(case)``: every
        #: verdict's evidence names its device(s), this judge's too
        self.devices: Dict[int, str] = {}
        #: each decomposed run's identity (``run_key``), by ``id`` of its ``RunReleases``
        self.keys: Dict[int, str] = {}
        #: the identities of the runs decomposed so far (the values of ``keys``, as a set)
        self.decomposed: set = set()
        #: the runs a ``releases_judged`` case judges itself (``add``)
        self.owned: set = set()
        #: the runs a ``SKIP_FACT`` case leaves out of this judge, and why (``add``)
        self.left_out: Dict[str, str] = {}
        #: each decomposed run's post-processing signature (``analysis/postprocessing.py``), by ``id``
        self.post: Dict[int, PostProcessing] = {}
        #: each decomposed run's release norms and dtype, by ``id``: a run of one or two releases is
        #: pinned when they equal its C or a norm pinned in a longer run
        self.norms: Dict[int, Tuple[List[float], str]] = {}
        #: each decomposed run whose released values themselves lie on a coarse grid (``coarse_grid``): its
        #: format and share, by ``id`` -- a grid finding there has two readings (``rounded_grid_message``)
        self.release_grid: Dict[int, Tuple[str, float]] = {}
        self.seconds = 0.0
        #: CPU seconds this process spent judging (what the judge costs, whatever the machine's load)
        self.cpu_seconds = 0.0

    def add(self, case: Case, outputs: Outputs) -> None:
        """Decompose every noisy run of ``case`` (``outputs[mode][spec][rank]``, prechecks passed); a
        case that leaves its runs out (``facts[SKIP_FACT]``, a reason) is not decomposed; nor is a
        case whose own property judges its releases with these tests (``facts["releases_judged"]``:
        ``noise_calibration``'s node and long runs) is left to that verdict, and so is the same run
        made for another property (``deadlock_free``'s long run is ``noise_calibration``'s: one job), so
        one finding is told once; a run two cases share is judged once (``verdicts``)."""
        keys = [run_key(case.world_size, mode.apply(spec)) for mode in case.modes for spec in case.specs]
        if case.facts.get("releases_judged"):
            self.owned.update(keys)
            return
        if case.facts.get(SKIP_FACT):  # read its own way (the audit's canary run): not decomposed here
            self.left_out.update((k, str(case.facts[SKIP_FACT])) for k in keys)
            return
        t0, c0 = time.monotonic(), time.process_time()
        try:
            # one thread, as the ranks run (threads per core on shared cores slowed the reference several-fold)
            with one_thread(), torch.no_grad():
                for mode, runs in zip(case.modes, outputs):
                    last: Dict[object, dict] = {}
                    # an explored resume point's halves are one run for the repeat test (a fixed case's are
                    # checkpoint_resume's to judge: it names a replay, noise_replayed)
                    halves: Dict[object, list] = {}
                    for spec, ranks in zip(case.specs, runs):
                        spec = mode.apply(spec)
                        identity = run_key(case.world_size, spec)
                        if identity in self.decomposed:
                            continue  # the same run, made for an earlier case: already decomposed
                        key = repr(sorted((k, v) for k, v in asdict(spec).items()
                                          if k not in ("phase", "checkpoint_dir")))
                        start = last.get(key) if spec.phase == "load" else None
                        if spec.phase == "save" and ranks and ranks[0].steps:
                            last[key] = ranks[0].steps[-1].parameters
                        earlier = halves.setdefault(key, []) if case.explored and spec.phase else None
                        found = decompose(spec, case.world_size, ranks, start, earlier)
                        if found is not None and found.cells:
                            self.runs.append((case, found))
                            self.keys[id(found)] = identity
                            self.decomposed.add(identity)
                            norms = release_norms([st.gradient for st in ranks[0].steps],
                                                  sorted(ranks[0].steps[0].gradient))
                            self.norms[id(found)] = (norms, spec.dtype if spec.precision == "fp32" else "mixed")
                            post = pinned(*self.norms[id(found)])
                            grid = coarse_grid(torch.cat([flat(st.gradient) for st in ranks[0].steps]),
                                               self.norms[id(found)][1])
                            if grid is not None:
                                self.release_grid[id(found)] = grid
                            if post is not None:
                                self.post[id(found)] = post
                            device = device_facts(ranks).get("device")
                            if device:
                                self.devices[id(case)] = str(device)
        except Exception as e:  # a bug in the judge: an internal_error verdict, never a verdict on the target
            self.errors.append((case, f"{type(e).__name__}: {e}", traceback.format_exc()))
        finally:
            self.seconds += time.monotonic() - t0
            self.cpu_seconds += time.process_time() - c0

    def _device(self, cases: List[Case]) -> Dict[str, str]:
        """``{"device": ...}`` of the ranks that made ``cases``' runs (joined when they differ), or ``{}``."""
        seen = list(dict.fromkeys(self.devices[id(c)] for c in cases if id(c) in self.devices))
        return {"device": ", ".join(seen)} if seen else {}

    def judged(self) -> List[Tuple[Case, RunReleases]]:
        """The runs this judge tells of: every decomposed run but those whose own property judged their
        releases (``add``), even where another property's case asked for the same run and was judged
        first."""
        return [(c, r) for c, r in self.runs if self.keys[id(r)] not in self.owned | set(self.left_out)]

    def _failure(self, case: Case, run: RunReleases, f, runs: List[RunReleases], alpha: float) -> Verdict:
        """The ``fail`` verdict of finding ``f`` in ``run`` (made for ``case``), its cause named against
        what the other ``runs`` released at the same place (``contrasts``)."""
        norms, dtype = self.norms.get(id(run), ([], "float32"))
        values = sorted({p.value for p in self.post.values()}) + [run.clip]
        post = (self.post.get(id(run)) or pinned(norms, dtype, values)) if noisy_finding(f) else None
        owner = case.property
        # a release changed after its noise: the noise tests read the transformed noise, the cause is the change
        grid = self.release_grid.get(id(run)) if f.kind in ("grid", "coarse") and not post else None
        at = where(owner, config_label(case.config()), run)
        # too little noise, or the noisy release rescaled after it: the signal's factor says which, if it can
        sig = None if post or grid else signal.read_finding(run.signal, f.kind, f.ratio, f.scope)
        diagnosis, message = (
            (POST_PROCESSED, post_processing_message(post, at)) if post else (None, rounded_grid_message(*grid, at))
            if grid else judged_message(f, owner, config_label(case.config()), run, alpha, contrasts(run, runs, f)))
        v = replace(case, property=PROPERTY_ID).verdict(
            "fail", diagnosis or DIAGNOSIS[f.kind], message,
            {"releases_of": owner, "finding": f.kind, "scope": f.scope, "steps": list(f.steps),
             "ranks": list(f.ranks), "std_ratio": f.ratio, "p": f.p, "alpha_per_test": alpha,
             "dtype": run.dtype, "lr": run.lr, **self._device([case]),
             **({"signal_reading": sig.kind, "signal_factor": sig.factor, "signal_error": sig.error} if sig else {})})
        v.config = {**case.config(), "releases": owner}
        # the release judge's verdicts are noise_calibration's: a run made for it is replayed by it alone
        v.repro = (case.repro() if owner == PROPERTY_ID else
                   case.repro().replace(f"--properties {owner}", f"--properties {owner},{PROPERTY_ID}", 1))
        return v

    def verdicts(self, opts: Options) -> List[Verdict]:
        t0 = time.monotonic()
        base = {"world_size": None, "data_layout": None, "model": None, "mode": opts.modes[0].label,
                "grad_sample_mode": opts.grad_sample_mode}
        out: List[Verdict] = []
        for case, message, details in self.errors[:1]:
            out.append(Verdict(PROPERTY_ID, "error", {**case.config(), "releases": case.property},
                               diagnosis=INTERNAL_ERROR, message=f"judging the releases of {case.property} "
                               f"[{config_label(case.config())}] failed: {message}", details=details))
        judged = self.judged()
        runs = [r for _, r in judged]
        groups = pooled_groups(runs)
        tests = sum(tests_of(r) for r in runs) + len(groups)
        if not runs:
            return out
        alpha = ALPHA / max(1, tests)
        failed_cases = set()
        for case, run in judged:
            if id(case) in failed_cases:
                continue
            f = run_tests(run, alpha)
            if f is None:
                continue
            failed_cases.add(id(case))
            out.append(self._failure(case, run, f, runs, alpha))
        pooled = pooled_tests(runs, alpha)
        seconds = round(self.seconds + time.monotonic() - t0, 3)
        if pooled and not failed_cases:
            out.append(Verdict(PROPERTY_ID, "fail", {**base, "releases": "pooled"}, diagnosis="mismatch",
                               message=pooled_message(pooled, alpha),
                               evidence={"pooled": [list(p) for p in pooled], "alpha_per_test": alpha,
                                         **self._device([c for c, _ in judged])},
                               seconds=seconds))
        if not failed_cases and not pooled:
            cells = [c for r in runs for c in r.cells]
            df = sum(c.df for c in cells)
            ratio = (sum(c.ss for c in cells) / df) ** 0.5 if df else float("nan")
            counts: Dict[str, int] = {}
            for case, _ in judged:
                counts[case.property] = counts.get(case.property, 0) + 1
            steps = sum(len({c.step for c in r.cells}) for r in runs)
            skipped = [why for r in runs for _, why in r.skipped]
            out.append(Verdict(PROPERTY_ID, "pass", {**base, "releases": "every run"}, message=pass_message(
                counts, len(cells), steps, len(runs), tests, alpha, detectable_ratio(df, alpha), skipped, ratio),
                evidence={"runs": len(runs), "runs_by_property": counts, "releases": len(cells), "steps": steps,
                          "tests": tests, "alpha_per_test": alpha, "std_ratio": ratio,
                          "dtypes": sorted({r.dtype for r in runs}), "skipped_steps": len(skipped),
                          "judge_cpu_seconds": round(self.cpu_seconds, 3),
                          **self._device([c for c, _ in judged])},
                seconds=seconds))
        return out


def run_key(world_size: int, spec) -> str:
    """One run's identity: its world size and spec (seeds and checkpoint directory included), so that
    cases that share a job (``runner.run_cases``' ``shared``) share one entry."""
    return f"{world_size}:{sorted(asdict(spec).items())!r}"


__all__ = ["SKIP_FACT", "PROPERTY_ID", "ALPHA", "Ledger", "run_key"]
