"""False alarms of the properties on the correct specimen: run every property N times on
``fixtures.specimens:Correct`` (both norm modes, world sizes 1 and 2, each property's default
dtypes) and count verdicts that are not ``pass``.

Two kinds of verdicts, counted apart:

* deterministic (``Property.false_alarm_rate`` is None): a float64/float32 comparison against the
  reference; a correct target must never fail one, whatever the run;
* statistical (``false_alarm_rate`` set, e.g. the noise tests): each run has its own run seed
  (``Options.seed``, as each gate run does), from which the properties derive their noise and
  sampling seeds, so the tests are exercised on fresh draws; a correct target fails one run of such a property
  with probability <= its ``false_alarm_rate`` (Bonferroni over every test of every verdict of the
  run), so the expected number of false alarms is <= runs x rate, printed next to the count.

    python benchmarks/false_alarms.py [--runs 20] [--seed S] [--models lora,tied] [--properties noise_calibration]
        [--precisions bf16-fsdp,bf16-autocast] [--wide-world-size 3] [--horizon 48] [--reach-only]
    (run i uses run seed S + i)

``--accountant N`` (no ranks, seconds): N verdicts of ``noise_calibration``'s accountant check
alone (``properties/analysis/accountant.py``) on exactly Gaussian noise of the right std, an RDP accountant
told the configured (sigma, q, steps) and reporting its epsilon: the check's own false alarms
(expected <= N x 2 x its per-test level), far more draws than gate runs give it.

``--tiny N``: N random tiny models (mlp d_in 1-2, hidden 1-3; transformer d_model 2-4, d_ff 1-2,
vocab 2-3, seq_len 2-3: the shapes the fuzzer shrinks to) replayed against ``Correct`` through
``norm_fidelity`` at 1 or 2 ranks (``fuzz.check_example``): the clip-coefficient recovery on nearly
collinear samples, whose rounding it must judge around (``clipfit.rounding_floor``), never alarm.

``--streams N`` (no ranks): N verdicts of ``checkpoint_resume``'s stream-level cross-rank check
(``checkpoint_resume.shared_values``) on independent rank streams shaped like the default 2-rank
resume (the mlp's uneven shards over the 2 post-resume steps): alarms expected <= N x its stated
bound (~1e-12).

The gate's wide world size and long runs (``docs/horizon.md``) are included as the gate runs them
(``--wide-world-size 3 --horizon 48``; 0 leaves them out); ``--reach-only`` runs only those cases
(each property's wide and long-run cases, not its matrix): their false alarms over many runs in a
fraction of the time.

``--models`` runs every property on those models instead of each property's own (e.g. the
fine-tuning models, ``docs/finetune.md``); ``--properties`` runs only those properties;
``--precisions`` the mixed-precision forms (``docs/precision.md``; a property that does not judge
them gives a skip).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpfsdp_verify.harness import Pool  # noqa: E402
from dpfsdp_verify.properties import REGISTRY  # noqa: E402
import dpfsdp_verify.properties as props  # noqa: E402
from dpfsdp_verify.properties.engine.contract import Case  # noqa: E402
from dpfsdp_verify.properties.engine.horizon import HORIZON_STEPS, WIDE_WORLD_SIZE  # noqa: E402
from dpfsdp_verify.properties.engine.runner import judge_cases  # noqa: E402

TARGET = "fixtures.specimens:Correct"
MODES = {"immediate": {"OPACUS_USE_DEFERRED_NORM": "0"}, "deferred": {"OPACUS_USE_DEFERRED_NORM": "1"}}


def accountant_false_alarms(n: int, seed: int, alpha: float = 3.4e-6) -> int:
    """Alarms of the accountant check over ``n`` simulated correct verdicts shaped like the default
    gate's 2-rank Poisson one (24 draws of 3280 coordinates, q = 1/4, 12 steps, D = 4) at its
    per-test level ``alpha``."""
    import torch

    from dpfsdp_verify.targets import accounting
    from dpfsdp_verify.properties.analysis.accountant import accountant_problem
    from dpfsdp_verify.targets import RankOutput, RunSpec, StepOutput

    spec = RunSpec(noise_multiplier=1.0, max_grad_norm=1.0, lr=0.0, steps=12, sampling="poisson", sample_rate=0.25,
                   dataset_size=16, epochs=3)
    specs = [spec.with_(noise_multiplier=0.0), spec.with_(accountant_delta=1e-5), spec]
    history = [(1.0, 0.25, 12)]
    eps = accounting.epsilon(history, 1e-5)
    steps = [StepOutput(indices=[k % 16, (k + 7) % 16, (k + 11) % 16, (k + 13) % 16], norms=None, loss=0.0)
             for k in range(12)]
    runs = [[RankOutput(0, 1, steps=steps, accountant="rdp", accountant_history=history, epsilon=e)]
            for e in (None, eps, None)]
    g = torch.Generator().manual_seed(seed)
    alarms = 0
    for _ in range(n):
        noise = [[{"w": torch.randn(3280, generator=g, dtype=torch.float64) / spec.divisor} for _ in range(12)]
                 for _ in range(2)]
        alarms += accountant_problem(specs, runs, noise, ["w"], alpha) is not None
    return alarms


def tiny_model_false_alarms(n: int, seed: int) -> list:
    """Alarms of ``norm_fidelity`` on ``Correct`` over ``n`` random tiny models (``--tiny``)."""
    import random

    from dpfsdp_verify import fuzz
    from dpfsdp_verify.properties import Options
    from dpfsdp_verify.targets import RunSpec

    rng, alarms = random.Random(seed), []
    with Pool(max_groups=2) as pool:
        for _ in range(n):
            if rng.random() < 0.5:
                dims = {"d_in": rng.choice([1, 2]), "hidden": rng.choice([1, 2, 3]), "classes": rng.choice([2, 3])}
                model = "mlp"
            else:
                dims = {"d_model": rng.choice([2, 3, 4]), "d_ff": rng.choice([1, 2]), "vocab": rng.choice([2, 3]),
                        "seq_len": rng.choice([2, 3]), "n_heads": 1}
                model = "transformer"
            spec = RunSpec(model=model, model_kwargs=tuple(sorted(dims.items())), model_seed=rng.randrange(1000),
                           batch_seed=rng.randrange(1000), global_batch_size=rng.choice([2, 3, 4, 5, 6, 8]),
                           data_layout=rng.choice(["split", "replicated"]), reduction=rng.choice(["mean", "sum"]),
                           dtype=rng.choice(["float64", "float32"]))
            ws = rng.choice([1, 2])
            v = fuzz.check_example("norm_fidelity", Options(target=TARGET), spec, ws, pool=pool)
            if v.status != "pass":
                alarms.append(f"world_size={ws} {spec}: {v.status} {v.diagnosis}: {v.message}")
    return alarms


def stream_false_alarms(n: int, seed: int) -> tuple:
    """``(alarms, bound)`` of the stream-level cross-rank check over ``n`` pairs of independent rank
    streams (``--streams``)."""
    import torch

    from dpfsdp_verify.properties.training.checkpoint_resume import NOISE_EQUAL, shared_values, shared_values_needed

    sizes = (228, 210)  # the default mlp's two uneven shards' noise values over both post-resume steps
    eps = NOISE_EQUAL["float64"]
    m, bound = shared_values_needed(max(sizes), max(sizes), eps, 1)
    g = torch.Generator().manual_seed(seed)
    alarms = sum(shared_values(torch.randn(sizes[0], generator=g, dtype=torch.float64),
                               torch.randn(sizes[1], generator=g, dtype=torch.float64), eps) >= m
                 for _ in range(n))
    return alarms, bound


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=None, help="first run seed (default: random, printed)")
    ap.add_argument("--models", default=None, help="comma-separated models (default: each property's own)")
    ap.add_argument("--properties", default="", help="comma list of property ids (default: all)")
    ap.add_argument("--precisions", default=None, help="comma list of precisions (default: fp32 only)")
    ap.add_argument("--accountant", type=int, default=0, metavar="N",
                    help="simulate N verdicts of the accountant check alone (no ranks) and stop")
    ap.add_argument("--tiny", type=int, default=0, metavar="N",
                    help="replay N random tiny models against Correct's norm_fidelity and stop")
    ap.add_argument("--streams", type=int, default=0, metavar="N",
                    help="simulate N verdicts of checkpoint_resume's stream-level cross-rank check (no ranks) and stop")
    ap.add_argument("--wide-world-size", type=int, default=WIDE_WORLD_SIZE, help="as the gate's (0: none)")
    ap.add_argument("--horizon", type=int, default=HORIZON_STEPS, help="as the gate's (0: none)")
    ap.add_argument("--reach-only", action="store_true", help="only the wide world size's and the long runs' cases")
    args = ap.parse_args(argv)
    if args.accountant:
        t0 = time.perf_counter()
        n_alarms = accountant_false_alarms(args.accountant, args.seed or 0)
        print(f"accountant check: {args.accountant} simulated correct verdicts, {n_alarms} false alarm(s) (expected "
              f"<= {args.accountant * 2 * 3.4e-6:.3g}); {time.perf_counter() - t0:.0f} s")
        return 1 if n_alarms else 0
    if args.tiny:
        t0 = time.perf_counter()
        found = tiny_model_false_alarms(args.tiny, args.seed or 0)
        print(f"tiny models: {args.tiny} norm_fidelity verdicts on Correct, {len(found)} false alarm(s) (expected 0); "
              f"{time.perf_counter() - t0:.0f} s")
        for a in found:
            print("  " + a)
        return 1 if found else 0
    if args.streams:
        t0 = time.perf_counter()
        n_alarms, bound = stream_false_alarms(args.streams, args.seed or 0)
        print(f"resume stream check: {args.streams} simulated correct verdicts, {n_alarms} false alarm(s) (expected "
              f"<= {args.streams * bound:.3g}); {time.perf_counter() - t0:.0f} s")
        return 1 if n_alarms else 0
    axes = {"models": tuple(args.models.split(","))} if args.models else {}
    if args.precisions:
        axes["precisions"] = tuple(args.precisions.split(","))
    # an opt-in property (the privacy audit: benchmarks/audit.py) only when named
    registry = [p for p in REGISTRY if (p.id in args.properties.split(",") if args.properties else not p.opt_in)]
    if args.seed is None:
        import random

        args.seed = random.SystemRandom().randrange(1, 2 ** 30)
    print(f"run seeds {args.seed}..{args.seed + args.runs - 1}", file=sys.stderr, flush=True)
    counts = collections.Counter()
    alarms = []
    t0 = time.perf_counter()
    with Pool(max_groups=4) as pool:
        for run in range(args.runs):
            for prop in registry:
                failed = False
                kw = dict(world_sizes=(1, 2), modes=MODES, seed=args.seed + run, wide_world_size=args.wide_world_size,
                          horizon=args.horizon, **axes)
                found = reach_verdicts(prop, pool, kw) if args.reach_only else props.run(prop, TARGET, pool=pool, **kw)
                for v in found:
                    counts[(prop.id, v.status)] += 1
                    if v.status not in ("pass", "skip"):
                        failed = True
                        alarms.append((prop, f"run {run}: {prop.id} {v.config} {v.status} {v.diagnosis}: {v.message}"))
                counts[(prop.id, "runs with an alarm")] += failed
            print(f"run {run + 1}/{args.runs} done, {len(alarms)} false alarm(s) so far "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    for kind, group in (("deterministic", [p for p in registry if p.false_alarm_rate is None]),
                        ("statistical", [p for p in registry if p.false_alarm_rate is not None])):
        verdicts = sum(n for (pid, s), n in counts.items() if s != "runs with an alarm" and
                       any(p.id == pid for p in group))
        n_alarms = sum(1 for p, _ in alarms if p in group)
        expected = sum(args.runs * p.false_alarm_rate for p in group if p.false_alarm_rate)
        print(f"{kind}: {verdicts} verdicts, {n_alarms} false alarm(s) "
              + (f"(expected <= {expected:.3g}: {args.runs} runs x the per-run rate of "
                 + ", ".join(f"{p.id} {p.false_alarm_rate:g}" for p in group) + ")" if group and kind == "statistical"
                 else "(expected 0)"))
        for p in group:
            row = {s: n for (pid, s), n in counts.items() if pid == p.id}
            print(f"  {p.id:<18} {row}")
    print(f"{time.perf_counter() - t0:.0f} s")
    for _, a in alarms:
        print("  " + a)
    return 1 if alarms else 0


def reach_verdicts(prop, pool, kw):
    """The verdicts of ``prop``'s cases beyond the matrix only: at the wide world size, and its long run."""
    opts = prop.options(TARGET, **kw)
    cases = [c for c in prop.plan(opts) if isinstance(c, Case)
             and (c.world_size == opts.wide_world_size or "horizon" in c.labels)]
    return judge_cases(prop, cases, pool, opts.timeout) if cases else []


if __name__ == "__main__":
    sys.exit(main())
