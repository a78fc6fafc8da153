"""Labs: small, reproducible experiments that show a failure mode and its remedy side by side.

`keel lab NAME [--out DIR] [--quick] [--seeds K] [--rl key=value ...] [key=value ...]` runs one lab on CPU within a small budget
and writes, into its directory (runs/lab-NAME by default): `summary.md` (what was run and the
headline numbers), `results.json` (every number behind them) and one or more PNG charts.
`--quick` shrinks everything for a smoke run; overrides apply to every training run of the
lab (e.g. `device=cuda`), the warm start's included; `--rl key=value` to the arms' RL runs alone.

Labs that compare training variants share one warm start: it runs once per machine and config,
is kept in keelrl's cache (`keelrl.labs.common.cached_student`; warm/student.json names it), and
every variant starts RL from it with the same seed, so the variants differ in the one setting the
lab is about. `--seeds K` repeats every arm at K seeds from that same student and reports each
number's spread over seeds and each effect's verdict against the noise (`keelrl.labs.seeds`).

One module per lab, each described in its docstring: `reward_hacking` (the guessing game's),
and `credit`, `curriculum`, `distill`, `dynamic_sampling` and `entropy` (each with the guessing
game's too), `reward_hacking_coding` and `stale_ratios` (on SmolLM2); `common` holds their shared
settings and helpers, `seeds` the statistics over seeds. This module keeps the registry (`LABS`) and `run_lab`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Sequence

from keelrl.labs.common import (ENTROPY, GUESS, HACK, KEEP_CHECKPOINTS, LAB_FAST, QUICK, QUICK_GUESS, RL_OVERRIDES,
                                RL_SEED, USER_OVERRIDES, LabResult, config)
from keelrl.labs.credit import CREDIT, CREDIT_QUICK, lab_credit
from keelrl.labs.distill import DISTILL, DISTILL_QUICK, lab_distill
from keelrl.labs.dynamic_sampling import DYNAMIC, DYNAMIC_QUICK, lab_dynamic_sampling, lab_dynamic_sampling_guess
from keelrl.labs.curriculum import CURRICULUM, CURRICULUM_QUICK, lab_curriculum
from keelrl.labs.entropy import ENTROPY_CODING, ENTROPY_QUICK, lab_entropy, lab_entropy_guess
from keelrl.labs.reward_hacking import lab_reward_hacking_guess
from keelrl.labs.reward_hacking_coding import HACKING, HACKING_QUICK, lab_reward_hacking
from keelrl.labs.seeds import combine, effects_section
from keelrl.labs.stale_ratios import RATIO_CLIPS, STALE, STALE_QUICK, lab_stale_ratios

__all__ = [
    "ENTROPY", "GUESS", "HACK", "LABS", "LAB_FAST", "QUICK", "QUICK_GUESS", "RATIO_CLIPS", "LabFn", "LabResult",
    "lab_credit", "lab_distill", "lab_dynamic_sampling", "lab_dynamic_sampling_guess", "lab_curriculum", "lab_entropy",
    "lab_entropy_guess", "lab_reward_hacking",
    "lab_reward_hacking_guess", "lab_settings",
    "lab_stale_ratios",
    "run_lab",
]

LabFn = Callable[[Path, Sequence[str], bool, Callable[[str], None]], LabResult]

LABS: dict[str, tuple[str, LabFn, list[str]]] = {
    "stale-ratios": ("importance weights by ratio, objective, staleness and length, and held-out success after "
                     "training each objective on stale batches (SmolLM2, multi-turn coding)", lab_stale_ratios, STALE),
    "dynamic-sampling": ("GRPO with and without dynamic sampling on the same sampled rollouts (SmolLM2, multi-turn "
                         "coding)", lab_dynamic_sampling, DYNAMIC),
    "dynamic-sampling-guess": ("DAPO with and without dynamic sampling (guessing game)", lab_dynamic_sampling_guess,
                               GUESS),
    "entropy": ("exploration collapse at a cold sampling temperature, without and with an entropy bonus, and at "
                "the default temperature (SmolLM2, multi-turn coding)", lab_entropy, ENTROPY_CODING),
    "entropy-guess": ("entropy collapse without a bonus vs with one (guessing game)", lab_entropy_guess, ENTROPY),
    "curriculum": ("the success-rate curriculum over the bug kinds vs uniform task draws (SmolLM2, multi-turn coding)",
                   lab_curriculum, CURRICULUM),
    "reward-hacking": ("training on the weak and the brittle verifier vs the strong one (SmolLM2, multi-turn coding)",
                       lab_reward_hacking, HACKING),
    "reward-hacking-guess": ("training on the weak verifier vs the strong one (guessing game)", lab_reward_hacking_guess,
                             HACK),
    "credit": ("GRPO vs PPO + value head with turn-level GAE vs GRPO + process reward model (SmolLM2, "
               "multi-turn coding)", lab_credit, CREDIT),
    "distill": ("GRPO vs on-policy distillation vs self-distillation (SmolLM2)", lab_distill, DISTILL),
}
"""name -> (description, function, the settings it runs on over LAB_FAST; those of a lab in
REAL_MODEL_LABS are complete on their own)."""

REAL_MODEL_LABS = {"distill": DISTILL_QUICK, "credit": CREDIT_QUICK, "reward-hacking": HACKING_QUICK,
                   "stale-ratios": STALE_QUICK, "dynamic-sampling": DYNAMIC_QUICK, "entropy": ENTROPY_QUICK,
                   "curriculum": CURRICULUM_QUICK}
"""Labs that run the default pretrained model, not the tiny one: their settings replace the tiny
recipe and LAB_FAST, and --quick swaps in the given tiny-model settings."""


def lab_settings(name: str, overrides: Sequence[str] = (), quick: bool = False) -> list[str]:
    """The overrides every training run of lab `name` starts from; the user's come last and win."""
    base = LABS[name][2]
    if name in REAL_MODEL_LABS:
        return [*base, *(REAL_MODEL_LABS[name] if quick else []), *overrides]
    quick_settings = (QUICK_GUESS if "env.name=guess" in base else QUICK) if quick else []
    from keelrl.config import TINY_RUN

    return [*TINY_RUN, *LAB_FAST, *base, *quick_settings, *overrides]


def run_lab(name: str, out: str | Path | None = None, overrides: Sequence[str] = (), quick: bool = False,
            progress: Callable[[str], None] | None = None, seeds: int = 1,
            keep_checkpoints: bool = False, rl_overrides: Sequence[str] = ()) -> LabResult:
    """Run lab `name` into `out` (default runs/lab-NAME); writes summary.md and results.json.

    `overrides` apply to every training run of the lab, its warm start included (so a setting the
    warm start reads makes a cached student of its own); `rl_overrides` to the arms' RL runs
    alone, after `overrides` (the warm start, and so the cached student, is untouched): the way
    to try a setting on a lab's remedy and baseline without a new student. results.json records
    both (`overrides`, `rl_overrides`).

    Each arm's final checkpoint (1.6 GB on SmolLM2) is removed once the arm has finished, unless
    `keep_checkpoints` (`keelrl.labs.common.drop_checkpoint`).

    With `seeds` K > 1 every arm runs K times, at seeds seed .. seed + K - 1 (the config's seed
    first), each repetition into out/seed-N/ from the same cached warm start; the summary and
    results give every number's mean and spread over seeds and each effect's verdict
    (`keelrl.labs.seeds`)."""
    if name not in LABS:
        raise KeyError(f"unknown lab {name!r}; valid names: {', '.join(LABS)}")
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seeds must be an integer >= 1, got {seeds!r}")
    directory = Path(out or f"runs/lab-{name}")
    function = LABS[name][1]
    settings = lab_settings(name, overrides, quick)
    first_seed = config(directory, settings).seed  # a bad override fails here, before any work
    config(directory, [*settings, *rl_overrides])  # and so does a bad RL-only one
    directory.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda message: None)
    started = time.monotonic()
    token = USER_OVERRIDES.set(tuple(overrides))
    rl_token = RL_OVERRIDES.set(tuple(rl_overrides))
    keep_token = KEEP_CHECKPOINTS.set(keep_checkpoints)
    try:
        if seeds == 1:
            result = function(directory, settings, quick, say)
            result.summary += "\n\n" + effects_section([result]) if result.effects else ""
        else:
            results: list[LabResult] = []
            chosen = list(range(first_seed, first_seed + seeds))
            for seed in chosen:
                say(f"seed {seed} ({len(results) + 1} of {seeds})")
                (directory / f"seed-{seed}").mkdir(exist_ok=True)
                seed_token = RL_SEED.set((f"seed={seed}",))
                try:
                    one = function(directory / f"seed-{seed}", settings, quick, say)
                finally:
                    RL_SEED.reset(seed_token)
                write_result(directory / f"seed-{seed}", one)
                results.append(one)
            result = combine(name, chosen, results)
    finally:
        USER_OVERRIDES.reset(token)
        RL_OVERRIDES.reset(rl_token)
        KEEP_CHECKPOINTS.reset(keep_token)
    seconds = time.monotonic() - started
    result.numbers = {**result.numbers, "lab_seconds": round(seconds, 1), "overrides": list(overrides),
                      "rl_overrides": list(rl_overrides)}
    given = [f"{where} {' '.join(values)}" for where, values in
             (("every run", overrides), ("the RL runs alone", rl_overrides)) if values]
    if given:
        result.summary += "\n\nSettings given: " + "; ".join(given) + "."
    result.summary += f"\n\nLab wall time: {seconds:.0f} s" + (f" ({seconds / seeds:.0f} s a seed)." if seeds > 1 else ".")
    write_result(directory, result)
    return result


def write_result(directory: Path, result: LabResult) -> None:
    """summary.md and results.json of `result` into `directory`, added to its files."""
    (directory / "summary.md").write_text(result.summary + "\n")
    (directory / "results.json").write_text(json.dumps(result.numbers, indent=2, default=str))
    result.files += [directory / "summary.md", directory / "results.json"]
