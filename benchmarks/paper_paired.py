"""The paired LLE vs LLE-VGN test (``scripts/paper_paired_test.py``), as the document quotes it.

The test itself (McNemar on the same test digits, a paired bootstrap of the NLL, more training
seeds) is run by that script, which writes :data:`PAIRED_TEST`. This module checks that the file
belongs to the models being documented (:func:`paired_matches`: a stale file is not quoted) and
turns its numbers into the sentences of the summary and of the disagreements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks.paper_config import ROOT, SEED, display_path
from benchmarks.paper_stats import ConfigResult

#: Paired test of LLE vs LLE-VGN written by ``scripts/paper_paired_test.py`` (read when present).
PAIRED_TEST = ROOT / "docs" / "paper" / "vgn-paired-test.json"


def _p(value: float) -> str:
    """A p-value as the document prints it: ``0.014``, ``0.61``, ``1.0``."""
    return "1.0" if value >= 0.995 else f"{value:.2g}"


def _paired_seeds(paired: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """The seed-:data:`SEED` entry of a paired-test file and the other seeds' entries."""
    seeds = paired["by_seed"]
    return seeds[str(SEED)], [(s, v) for s, v in sorted(seeds.items()) if s != str(SEED)]


def paired_matches(paired: Mapping[str, Any] | None, results: Sequence[ConfigResult]) -> bool:
    """Whether a paired-test file was run on the models of ``results`` (its ``committed``
    accuracy and NLL are theirs); a stale file is not quoted."""
    if not paired or str(SEED) not in paired.get("by_seed", {}):
        return False
    by = {r.spec.key: r for r in results}
    for key in ("lle", "lle-vgn"):
        if key not in by:
            return False
        ours, theirs = by[key].metrics["classification"], paired["committed"].get(key, {})
        for metric in ("accuracy", "nll"):
            if theirs.get(metric) is None or abs(theirs[metric] - ours[metric]) > 1e-9:
                return False
    return True


def paired_summary(paired: Mapping[str, Any]) -> str:
    """The sentence the summary adds to its 'VGN on LLE' line."""
    first, others = _paired_seeds(paired)
    p0 = first["mcnemar"]["p_exact_two_sided"]
    text = (
        "*(issue 33)* Paired on the same digits this seed's difference is "
        f"{'more than' if p0 < 0.05 else 'within'} test-set noise (McNemar exact p = {_p(p0)})"
    )
    if others:
        sign0 = np.sign(first["accuracy"][1] - first["accuracy"][0])
        repeat = [
            np.sign(v["accuracy"][1] - v["accuracy"][0]) == sign0
            and v["mcnemar"]["p_exact_two_sided"] < 0.05
            for _, v in others
        ]
        n = len(others)
        text += (
            f", {'and' if all(repeat) else 'but'} {n} more training seed{'s' * (n > 1)} "
            f"{'repeat' if all(repeat) else 'do not repeat'} it (p = "
            + " and ".join(_p(v["mcnemar"]["p_exact_two_sided"]) for _, v in others)
            + ")"
        )
    return text + ': see "VGN on LLE" under the disagreements.'


def paired_details(paired: Mapping[str, Any], results: Sequence[ConfigResult]) -> str:
    """The paired test's numbers for the 'VGN on LLE' disagreement, from the paired-test file."""
    by = {r.spec.key: r for r in results}
    committed = [by[k].metrics["classification"] for k in ("lle", "lle-vgn")]
    first, others = _paired_seeds(paired)
    n = int(first["n"])
    digits = max(
        round(abs(a - c["accuracy"]) * n) for a, c in zip(first["accuracy"], committed, strict=True)
    )
    dnll = max(abs(x - c["nll"]) for x, c in zip(first["nll"], committed, strict=True))
    mc, nd = first["mcnemar"], first["nll_difference"]
    lo, hi = nd["bootstrap_95"]
    text = (
        f"A paired test on the same {n:,} test digits (`{paired.get('command', '')}`, numbers "
        f"in `{display_path(PAIRED_TEST)}`; the committed metrics hold no per-digit data, so "
        "it retrains the pair exactly as `benchmarks.paper` does — the seed-"
        f"{SEED} retrain lands within {digits} digit{'s' * (digits != 1)} of the committed "
        f"accuracies, {first['accuracy'][0]:.3f} / {first['accuracy'][1]:.3f}, and within "
        f"{max(dnll, 1e-4):.1g} of their NLLs): of the "
        f"{mc['right_only_first'] + mc['right_only_second']} digits exactly one model gets "
        f"right, LLE gets {mc['right_only_first']} and LLE-VGN {mc['right_only_second']}, "
        f"McNemar exact p = {_p(mc['p_exact_two_sided'])}; the NLL "
        f"{'rises' if nd['mean'] > 0 else 'falls'} by {abs(nd['mean']):.3f} per digit (paired "
        f"bootstrap 95 % interval {lo:.3f}–{hi:.3f})."
    )
    if not others:
        return text
    text += " That test covers the sampling of test digits only, not training randomness"
    parts = []
    for seed, v in others:
        a, m, d = v["accuracy"], v["mcnemar"], v["nll_difference"]
        dlo, dhi = d["bootstrap_95"]
        parts.append(
            f"seed {seed} accuracy {a[0]:.4f} → {a[1]:.4f} ({m['right_only_first']} vs "
            f"{m['right_only_second']} discordant, p = {_p(m['p_exact_two_sided'])}), NLL "
            f"{d['mean']:+.3f} ({dlo:+.3f} to {dhi:+.3f})"
        )
    seeds = [first] + [v for _, v in others]
    mean_acc = [float(np.mean([s["accuracy"][i] for s in seeds])) for i in (0, 1)]
    mean_nll = [float(np.mean([s["nll"][i] for s in seeds])) for i in (0, 1)]
    best_first = first["accuracy"][0] >= max(s["accuracy"][0] for s in seeds)
    lowered = [1.0 - s["nll_difference"]["second_worse_share"] for s in seeds]
    text += (
        f", and {len(others)} more training seed{'s' * (len(others) > 1)} of the same protocol: "
        + "; ".join(parts)
        + f". Over the {len(seeds)} seeds LLE averages {mean_acc[0]:.4f} accuracy and "
        f"{mean_nll[0]:.3f} NLL, LLE-VGN {mean_acc[1]:.4f} and {mean_nll[1]:.3f}"
    )
    if best_first:
        text += (
            f"; seed {SEED}'s LLE is the best of the {len(seeds)} LLE runs ("
            + f"{first['accuracy'][0]:.4f} against "
            + " and ".join(f"{s['accuracy'][0]:.4f}" for _, s in others)
            + "), so read a disagreement with the paper's parity against the spread between seeds"
        )
    return (
        text + f". In every seed VGN lowers the NLL of {min(lowered):.0%}–{max(lowered):.0%} of "
        "the digits and raises it on the rest, a few confident errors most."
        if all(x > 0.5 for x in lowered)
        else text + "."
    )
