"""What an accountant verdict says about the history a target's accountant was told: the sentences of
a ``HistoryFinding`` (``engine.prechecks.accountant_history_problem`` on every run, and the history
checks of ``analysis.accountant.accountant_problem`` in noise_calibration). Pure functions of the
finding; nothing is detected here.
"""

from __future__ import annotations

from typing import cast

from ..analysis.findings import HistoryFinding


def fmt_history(history) -> str:
    """An opacus-format history ``[(sigma, q, steps)]`` as the messages print it."""
    return "[" + ", ".join(f"({s:.6g}, {q:.6g}, {int(n)})" for s, q, n in history) + "]"


def _capital(text: str) -> str:
    return text[0].upper() + text[1:]


def _where(f: HistoryFinding) -> str:
    return "" if f.resume_at is None else f" (a resumed run's load half, resumed after step {f.resume_at})"


def measured_history_message(f: HistoryFinding) -> str:
    """noise_calibration's history checks (``accountant_problem``): the ranks agree, report a history,
    and it composes the steps the run took."""
    if f.kind == "ranks_disagree":
        return ("the ranks' accountants were told different things in one run: "
                + "; ".join(f"rank {rank}: {fmt_history(h or [])}" for rank, h in f.told_by)
                + ". The accountant is one for the run: ranks that disagree report different epsilons for "
                "the same release")
    if f.kind == "no_history":
        return f"rank(s) of run {f.run} report no accountant history while others do"
    return (f"the accountant was told {f.told_steps} step(s) ({fmt_history(f.history)}), but the run "
            f"took {f.taken}: it composes {'fewer' if f.told_steps < f.taken else 'more'} releases than "
            "were made")


def _step_count_cause(f: HistoryFinding) -> str:
    return {"per_pass": "it was told one step per physical pass, not one per DP step",
            "lost_restored": (f"it lost the {f.first_step} step(s) taken before the checkpoint: its history starts "
                              "again at the resume"),
            "restored_twice": f"it composes the {f.first_step} step(s) restored from the checkpoint twice",
            "load_other": (f"after the resume it composes {f.after_resume} step(s) from before the checkpoint, not "
                           f"the {f.first_step} taken")}.get(f.how, "it does not compose one step per DP step")


def _step_count(f: HistoryFinding) -> str:
    meaning = ("PRIVACY VIOLATION in the accounting: the epsilon it reports is that of fewer releases than were "
               "made" if f.told_steps < f.taken else "the epsilon it reports is that of more releases than were made "
               "(over-reported)")
    return (f"the accountant was told {f.told_steps} step(s) ({fmt_history(f.history)}) but the run took "
            f"{f.taken}{_where(f)}: {_step_count_cause(f)}. {_capital(meaning)}.")


def _sigma(f: HistoryFinding) -> str:
    sigma = f.expected
    return (f"{_HEAD[f.direction]}the accountant was told noise multiplier(s) "
            f"{', '.join(f'{s:.6g}' for s in f.wrong)} ({fmt_history(f.history)}){_where(f)}, but the run's is "
            f"{sigma:g} ({f.wrong[0] / sigma if sigma else float('inf'):.4g} x): the epsilon it reports describes "
            "other noise than the noise added" + _TAIL[f.direction])


def _rate(f: HistoryFinding) -> str:
    q = f.expected
    accum = (f"; under gradient accumulation (physical batches of {f.physical_batch_size}) the rate of a logical step "
             "is q, never that of one pass" if f.physical_batch_size else "")
    return (f"{_HEAD[f.direction]}the accountant was told sampling rate(s) {', '.join(f'{r:.6g}' for r in f.wrong)} "
            f"({fmt_history(f.history)}){_where(f)}, but the sampler draws at q = {q:.6g} ({f.wrong[0] / q:.4g} x q)"
            f"{accum}: the epsilon it reports describes another sampling rate than the sampler's" + _TAIL[f.direction])


#: how an accountant message with a direction (``HistoryFinding.direction``) begins and ends
_HEAD = {"under": "PRIVACY VIOLATION in the accounting (epsilon under-reported): ",
         "over": "ACCOUNTING (epsilon over-reported, privacy intact): ", "": "PRIVACY ACCOUNTING: "}
_TAIL = {"under": "; the epsilon a user reads is smaller than the run's privacy loss",
         "over": "; the epsilon a user reads is larger than the run's privacy loss: the guarantee is understated "
                 "(utility of the guarantee, not privacy)", "": ""}


def _epsilon(f: HistoryFinding) -> str:
    if f.at_delta is not None:
        from ..analysis.accountant import wrong_delta_tail, wrong_delta_words

        return (f"{_HEAD[f.direction]}{wrong_delta_words(f.got, f.delta, f.at_delta)}{_where(f)} (the suite's own RDP "
                f"accountant on that history {fmt_history(f.history)} gives {f.want:.4g} at delta {f.delta:g})."
                + wrong_delta_tail(f.delta, f.at_delta))
    if f.at_steps is not None:
        return _epsilon_steps(f)
    side = (f"below {f.floor:.4g}, a sound lower bound on the true epsilon of that history (no valid accountant "
            "reports less" if f.direction == "under" else
            f"above {f.ceiling:.4g}, its classic RDP conversion (the loosest standard valid accounting")
    return (f"{_HEAD[f.direction]}the accountant reports epsilon {f.got:.4g} at delta {f.delta:g}{_where(f)}; a valid "
            f"epsilon of its history {fmt_history(f.history)} lies in {f.floor:.4g}..{f.ceiling:.4g} (the suite's RDP "
            f"accountant gives {f.want:.4g}), and {f.got:.4g} is {side}: PLD/PRV, RDP with the improved or the classic "
            f"conversion all lie inside){_TAIL[f.direction]}")


def _epsilon_steps(f: HistoryFinding) -> str:
    """An epsilon that is exactly another step count's of the told (sigma, q)."""
    told = sum(int(n) for _, _, n in f.history)
    k = cast(int, f.at_steps)
    which = {"since_resume": f": only the {k} steps this process took since the resume, the {told - k} restored "
                             "ones left out of the epsilon (a step counter the resume restarted)",
             "per_pass": f": one step per physical pass ({k} passes), not one per logical step (the optimizer's "
                         "step counter under gradient accumulation)"}.get(f.steps_how, "")
    tail = (" The epsilon a user reads is too small: a privacy violation in the accounting." if k < told else
            " The epsilon a user reads is overstated (utility of the guarantee, not privacy).")
    return (f"{_HEAD[f.direction]}the accountant reports epsilon {f.got:.4g} at delta {f.delta:g}{_where(f)}, which is "
            f"exactly the RDP epsilon of {k} steps of the sigma and q it was told, while its history "
            f"{fmt_history(f.history)} counts {told}{which} (the suite's own RDP accountant on that history gives "
            f"{f.want:.4g}); the history is right, the epsilon computed from it is not." + tail)


def history_message(f: HistoryFinding) -> str:
    """The ``accountant_mismatch`` message of ``engine.prechecks.accountant_history_problem``'s finding."""
    if f.kind == "ranks_disagree":
        told_by = [fmt_history(h) if h is not None else "none" for _, h in f.told_by]
        return ("the ranks' accountants report different histories for one run: "
                + "; ".join(f"rank {rank}: {t}" for (rank, _), t in zip(f.told_by, told_by))
                + _where(f) + ". The accountant is one for the run: ranks that disagree report different epsilons "
                "for the same release")
    if f.kind == "epsilons_differ":
        return f"the ranks report different epsilons for one run ({f.reported}){_where(f)}"
    return {"step_count": _step_count, "sigma": _sigma, "rate": _rate, "epsilon": _epsilon}[f.kind](f)


__all__ = ["HistoryFinding", "fmt_history", "measured_history_message", "history_message"]
