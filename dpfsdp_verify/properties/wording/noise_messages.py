"""What a ``noise_calibration`` verdict says when a statistical test fails: pure functions of the
statistics (``noise_stats.py``) and the verdict's ``where``; no test is computed here.
"""

from __future__ import annotations

import math
from typing import Tuple


def late_message(late, where: str, alpha: float) -> str:
    k, side, later, before = late
    low = side[0][2] < 1
    ratios = [r for _, _, r, _ in side]
    lead = "PRIVACY VIOLATION: too little noise" if low else "UTILITY LOSS: too much noise"
    after = f"; std ratio {sum(before) / len(before):.3f} on average before step {k}" if before else ""
    return (f"{lead} from step {k} (counted from 0) on {where}: the noise std is {min(ratios):.3f}..{max(ratios):.3f} "
            f"x sigma*C/D at {len(side)} of the {len(later)} releases from step {k} on (each step's two-sided "
            f"chi-square over all its coordinates, p < {alpha / (len(later) + len(before)):.2g}){after}. The first "
            "steps are calibrated; a change part-way through training (a schedule, a flag flipped after a warm-up, "
            "an epoch counter) " + ("releases the later steps with less noise than the accountant charges for."
                                    if low else "adds more noise than the guarantee needs."))


def empty_round_message(found, where: str) -> str:
    """``found``: ``noise_exact.empty_round_unnoised``'s tuple."""
    unnoised, empty, run, step, ranks = found
    who = (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} drew" if len(ranks) else "drew")
    return (f"PRIVACY VIOLATION: no noise in the {unnoised} release(s) whose Poisson round left a local batch "
            f"empty (first: step {step} of run {run}, where {who} 0 samples; {empty} draw(s) had an empty local "
            f"batch) {where}, while every release whose ranks all drew samples is noised: the noise scale depends on "
            "the batch (e.g. a std scaled by the batch's norms or its size), and is zero on an empty round. DP-SGD "
            "adds N(0, sigma^2 C^2) whatever was sampled -- an empty round releases noise alone -- so a release "
            "without noise tells which rounds drew nothing.")


def varying_scale_message(spread, s: float, mean_ratio: float, where: str, alpha: float, poisson: bool) -> str:
    """``spread``: ``noise_stats.scale_dispersion``'s tuple; ``mean_ratio``: the pooled std over sigma*C/D."""
    stat, dof, p, low, high = spread
    return (f"PRIVACY VIOLATION: the noise std varies across steps {where}: the releases' noise std ranges "
            f"{low * mean_ratio:.3f}..{high * mean_ratio:.3f} x sigma*C/D = {s:.4g} (their mean squares disperse "
            f"{stat / dof:.3g} x what one scale gives, within-release kurtosis accounted: chi-square {stat:.4g} on "
            f"{dof} degrees of freedom, p={p:.2g} < {alpha:.2g}). Each release needs noise of std sigma*C/D"
            + (", whatever the Poisson round drew (a std that follows the realised batch, e.g. normalised by the "
               "drawn batch size, is smaller exactly on the rounds that drew more)" if poisson else "")
            + ": the releases with less noise are less private than the accounting states (a mixture of scales, "
            "not a heavy-tailed distribution).")


def shape_message(excess: float, z_kurt: float, p_kurt: float, values: int, where: str, alpha: float) -> str:
    tails = ("heavy tails (excess kurtosis {:+.2f}; Laplace noise has +3): noise calibrated for another "
             "mechanism, which the Gaussian accountant does not cover" if excess > 0 else
             "light tails (excess kurtosis {:+.2f}; uniform noise has -1.2): bounded noise gives no DP "
             "guarantee at all").format(excess)
    return (f"PRIVACY VIOLATION: the noise is not Gaussian {where}: {tails} (kurtosis test over "
            f"{values} standardised values, z={z_kurt:.3g}, p={p_kurt:.2g} < {alpha:.2g}). Whatever its std, "
            "the privacy accounting (Renyi DP of the Gaussian mechanism) holds only for Gaussian "
            "noise.")


def independence_message(test: str, r_corr: float, p_corr: float, pairs: int, where: str, alpha: float) -> str:
    what = {"shard": "across shards (ranks seeded alike add the same noise to every shard)",
            "step": "between consecutive steps", "run": "between runs with different noise seeds"}[test]
    return (f"PRIVACY VIOLATION: the noise is not independent {what} {where}: correlation {r_corr:.3f} over "
            f"{pairs} coordinate pairs (Fisher z test p={p_corr:.2g} < {alpha:.2g}). The mechanism assumes "
            "independent noise on every coordinate of every release.")


def pairs_message(a, b, r_ij: float, t_pairs: float, n_pairs: int, p_pairs: float, where: str, alpha: float) -> str:
    """``a``, ``b``: the most correlated pair of draws, each as ``(run, step)``."""
    (ra, ka), (rb, kb) = a, b
    pair = (f"steps {ka} and {kb} of run {ra} (lag {kb - ka})" if ra == rb else
            f"step {ka} of run {ra} and step {kb} of run {rb}")
    return (f"PRIVACY VIOLATION: the noise of different releases is dependent {where}: over all {n_pairs} pairs of "
            f"draws (any lag, any run) sum of m*r^2 = {t_pairs:.4g}; most correlated: {pair}, r={r_ij:.3f} "
            f"(p={p_pairs:.2g} < {alpha:.2g}). Each release needs noise independent of every other release's; "
            "correlated noise partly cancels in the difference of two releases.")


#: a std ratio names a cause when it is within this fraction of the cause's ratio (the nearest one)
HINT_RTOL = 0.15


def formula_causes(name: str, value: float) -> Tuple[Tuple[float, str], ...]:
    """``(std ratio, cause)`` of a noise std formula that leaves ``name`` (sigma or C, at ``value``) out
    or has it twice: the ratios 1/value and value (``()`` for a value <= 0)."""
    if not value > 0:
        return ()
    return ((1 / value, f"1/{name} = {1 / value:.4g}: the noise std leaves {name} = {value:.4g} out"),
            (value, f"{name} = {value:.4g}: the noise std has {name} twice ({name}^2 in place of {name})"))


def ratio_hint(value: float, ws: int, mesh: str = "", sigma: float = 1.0, clip: float = 1.0) -> str:
    """The cause a noise std ratio ``value`` points to, as a sentence ("" if none): a 2-D mesh's
    divisor mistakes first, else the nearest of the world size's (1/sqrt(N), 1/N, N) and sigma's or
    C's (sigma or C left out of the std, or applied twice), within ``HINT_RTOL``."""
    for k, what in mesh_ratios(mesh):
        if abs(value - k) < HINT_RTOL * k:
            return f" The ratio is close to {what}."
    causes = []
    if ws > 1:
        causes += [(1 / math.sqrt(ws), "1/sqrt(N): noise drawn on every rank and averaged"),
                   (1 / ws, "1/N: noise divided by N once too often"),
                   (float(ws), "N: noise not divided by N although the ranks' gradients are averaged")]
    for name, v in (("sigma", sigma), ("C", clip)):
        if v > 0 and abs(math.log(v)) > 0.2:  # near 1 its ratios are the unexplained ones
            causes += formula_causes(name, v)
    near = [(abs(math.log(value / k)), what) for k, what in causes if value > 0 and abs(value - k) < HINT_RTOL * k]
    return f" The ratio is close to {min(near)[1]}." if near else ""


def scale_message(failure, ws: int, s: float, where: str, alpha: float, mesh: str = "", sigma: float = 1.0,
                  clip: float = 1.0) -> str:
    test, name, rank, value, p = failure[:5]
    shard = f" in rank {rank}'s shard" if ws > 1 and rank is not None else ""
    if test == "sum":
        width, draws = failure[5:]
        return (f"PRIVACY VIOLATION: the noise on {name!r}{shard} sums to ~0 in every release {where}: the sum of "
                f"its {width} coordinates is released with no noise (sum over the {draws} draws of "
                f"(sum of the shard's noise)^2 / ({width} s^2) = {value:.3g}, expected ~{draws}; lower-tail "
                f"chi-square p={p:.2g} < {alpha:.2g}). Noise centred per shard (its mean subtracted) leaves a "
                "linear statistic of the clipped gradient, their sum, un-noised: no privacy for it whatever the "
                "std of each coordinate.")
    if test == "mean":
        return (f"the noise on {name!r} is biased {where}: mean z={value:.3g} (p={p:.2g} < {alpha:.2g}); Gaussian DP "
                "noise has mean 0.")
    if test == "vectors":
        side = ("PRIVACY VIOLATION: too little noise" if value < 1 else "UTILITY LOSS: too much noise")
        return (f"{side} on the 1-D tensors (biases, norm weights: {name}), pooled, {where}: measured std "
                f"{value * s:.4g} = {value:.3f} x the required sigma*C/D = {s:.4g} (two-sided chi-square over all "
                f"their values, p={p:.2g} < {alpha:.2g}): their noise is calibrated with another formula than the "
                "weight matrices'." + (" The released gradient is less private than the accounting states."
                                       if value < 1 else ""))
    hint = ratio_hint(value, ws, mesh, sigma, clip)
    if value < 1:
        return (f"PRIVACY VIOLATION: too little noise on {name!r}{shard} {where}: measured std {value * s:.4g} = "
                f"{value:.3f} x the required sigma*C/D = {s:.4g} (two-sided chi-square p={p:.2g} < {alpha:.2g})."
                f"{hint} The released gradient is less private than the accounting states.")
    return (f"UTILITY LOSS: too much noise on {name!r}{shard} {where}: measured std {value * s:.4g} = {value:.3f} x "
            f"sigma*C/D = {s:.4g} (two-sided chi-square p={p:.2g} < {alpha:.2g}).{hint} Privacy holds, but the model "
            "trains on more noise than the guarantee needs.")


def mesh_ratios(name: str):
    """``(std ratio, cause)`` of the divisor mistakes a 2-D mesh invites (``dpfsdp_verify.targets.mesh``)."""
    if not name:
        return ()
    from ...targets.mesh import Mesh

    mesh = Mesh.parse(name)
    a, b = mesh.shape
    if mesh.tensor_parallel:
        return ((1 / b, f"1/{b} = D/W: noise divided by the world size W={a * b} where only the D={a} data replicas "
                        "average their gradients (the TP peers hold slices of one gradient and average nothing)"),)
    return ((float(a), f"{a} = W/S: noise divided by the shard group's {b} ranks instead of the world's {a * b}: the "
                       f"{a} replicas average the gradient too"),)



def low_rank_message(flat, where: str, alpha: float) -> str:
    return (f"PRIVACY VIOLATION: the noise on {flat.name!r} is low-rank {where}: in draw {flat.draw} its top singular "
            f"value is {flat.ratio:.3g} x its RMS ({flat.share:.0%} of the noise's energy in one direction); i.i.d. "
            f"Gaussian noise of that shape gives ~{flat.full_rank:.3g} and exceeds {flat.bound:.3g} with probability "
            f"< {alpha:.2g}. The coordinates' noise is linearly dependent (e.g. an outer product of two vectors): "
            "projected on its few directions, the released matrix carries almost no noise elsewhere.")


def tensor_pair_message(pair, at, where: str, alpha: float) -> str:
    """``at``: the ``(run, step)`` of the pair's most correlated draw."""
    run, step = at
    kind = ("one is the other negated" if pair.worst_r < -0.999 else
            "one is the other" if pair.worst_r > 0.999 else "a linear dependence")
    return (f"PRIVACY VIOLATION: the noise of {pair.a!r} and of {pair.b!r} (same shape) is dependent {where}: "
            f"correlation {pair.mean_r:+.3f} on average over {pair.draws} draws, {pair.worst_r:+.3f} at step {step} of "
            f"run {run} ({kind}; p={pair.p:.2g} < {alpha:.2g} over the {pair.pairs} pair(s) of equal-shape tensors). "
            "Each tensor's noise must be independent of every other's: a noise reused (negated or mixed) on another "
            "tensor cancels in a sum or difference of the two released tensors.")


__all__ = ["empty_round_message", "varying_scale_message", "late_message", "shape_message", "independence_message",
           "pairs_message", "scale_message", "mesh_ratios", "low_rank_message", "tensor_pair_message"]


def tail_message(t, kind: str, where: str, alpha: float) -> str:
    """The tail test's failure (``analysis.noise_tails``): ``kind`` ``"boundary"`` (the largest values
    pile up on one value: a clamp) or ``"mass"`` (too little mass beyond k sigma)."""
    k = t.worst_k
    mass = (f"{t.beyond[k]} of {t.values} values lie beyond {k:g} sigma where Gaussian noise puts "
            f"~{t.expected[k]:.3g} (p <= {t.p_mass:.2g})")
    if kind == "boundary":
        nth = {2: "2nd", 3: "3rd"}.get(t.m, f"{t.m}th")
        cut = (f"the noise's tail is cut at {t.top:.4g} sigma: its {t.m} largest |values| all lie at "
               f"{t.mth:.7g}..{t.top:.7g} sigma, a boundary value repeated (for Gaussian noise the gap between the "
               f"largest and the {nth} largest is that small with p = {t.p_boundary:.2g} < {alpha:.2g}); {mass}")
    else:
        cut = f"too little mass in the tail: {mass} < {alpha:.2g}; the largest |value| is {t.top:.4g} sigma"
    return (f"PRIVACY VIOLATION: the noise is not Gaussian {where}: light tails, {cut}. Noise clamped or "
            f"bounded at +-{t.top:.3g} sigma gives no DP guarantee at all: a gradient difference larger than twice "
            "the bound is told apart for sure, and the Gaussian accounting assumes the whole tail.")


def grid_message(grid, s: float, where: str) -> str:
    """Noise on a coarse grid (``analysis.noise_tails.coarse_grid``): ``(distinct, values, step, zero share)``."""
    distinct, n, step, zero = grid
    return (f"PRIVACY VIOLATION: the noise is not Gaussian {where}: it is discrete, rounded to a grid of step "
            f"{step / s:.3g} sigma*C/D -- {distinct} distinct values over {n} noise values ({zero:.1%} of them exactly "
            "0, where the noise rounds to 0: those coordinates look un-noised because of the grid). A discrete noise "
            "needs its own privacy analysis; the Gaussian accounting does not cover it.")
