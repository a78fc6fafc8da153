"""A group's rows split into passes by length, against the fewest passes the budget allows: what
the learner's step costs each way, and whether it updates the same.

The rows of one group share their prompt and run it once (`perf.share_prefix`), but their
continuations are padded to the group's longest: one five-turn episode of a thousand tokens
beside three of four hundred more than doubles the group's padded tokens. With a pass overhead
(`keelrl.policy.prefix.pass_overhead`: on a CPU, PASS_OVERHEAD_TOKENS) the plan splits such a group
into passes of similar length where that saves more padded tokens than the extra passes cost
(`plan_micro_batches`); the baseline plans as before, the fewest passes within
`perf.micro_batch_tokens`.

One RL step's rollouts of the SmolLM2 labs' shape (tasks x attempts, five turns, the coding
environment, at the rollout temperature) are sampled once; then the learner's step
(`Trainer.advantages`: the no-grad passes; `Learner.update`: the updates) runs on them
`--repeats` times a mode, the modes alternating, each from the same weights and optimiser state.
Figures: each mode's median seconds and the ratio, the padded tokens of one pass over the batch
by each plan, the passes each plan makes, and the largest difference between the two modes'
updated weights (float rounding only). The defaults are the distill lab's learner: minibatches
of one group, the reference KL at 0.04. The model is the labs' cached student
(`bench.common.labs_student`); `--model` takes another.

    python -m bench.bench_padding                 # the labs' student, 4 tasks x 4, minibatches of 4
    python -m bench.bench_padding --smoke         # tiny model, seconds: checks the harness runs
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import Clock, Ratio, Section, arguments, machine, sampled_step, step_arguments, write_section

MODES = ("fewest passes", "split by length")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = arguments(__doc__.split("\n\n")[0], out="padding")
    step_arguments(parser, minibatch=4)
    parser.add_argument("--kl", type=float, default=0.04, help="algo.kl_coef (above 0: a reference pass)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model = args.model or "tiny"
        args.tasks, args.group, args.minibatch, args.repeats = 2, 4, 4, 2
    return args


def padded(plan: Any, lengths: list[int]) -> int:
    """One pass's padded tokens: each micro-batch's units x longest cut + rows x widest
    continuation (rows x width for a plain one), as `keelrl.policy.prefix` runs it."""
    total = 0
    for micro in plan:
        if micro.units is None:
            total += len(micro.rows) * micro.width
            continue
        cut = max(unit.cut for unit in micro.units)
        widest = max(lengths[micro.rows[row]] - unit.cut for unit in micro.units for row in unit.rows)
        total += len(micro.units) * cut + len(micro.rows) * widest
    return total


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    import tempfile

    from keelrl.policy import prefix as prefix_module
    from keelrl.train.learner import prefix_keys

    real_overhead = prefix_module.pass_overhead
    with tempfile.TemporaryDirectory(prefix="keel-bench-padding-") as scratch:
        step = sampled_step(args, Path(scratch) / "run", [f"algo.kl_coef={args.kl}"])
        trainer, trajectories, batch, group_ids, first, tokens = (step.trainer, step.trajectories, step.batch,
                                                                  step.group_ids, step.first, step.tokens)
        cfg = trainer.cfg
        budget = cfg.perf.micro_batch_tokens
        lengths = [int(n) for n in batch.attention_mask.sum(1).tolist()]
        plans = {mode: prefix_module.plan_passes(batch.input_ids, batch.attention_mask, budget,
                                                 keys=prefix_keys(cfg.perf, batch), positions=batch.action_mask,
                                                 overhead=None if mode == MODES[0] else real_overhead(batch.input_ids.device))
                 for mode in MODES}

        def once(mode: str) -> dict[str, Any]:
            prefix_module.pass_overhead = real_overhead if mode == MODES[1] else (lambda device: None)
            step.reset()
            clock = Clock()
            estimated = trainer.advantages(batch, first_update=first)
            update = trainer.learner.update(estimated.inputs, group_ids, 1)
            load = clock.read()
            prefix_module.pass_overhead = real_overhead
            return {"seconds": load["wall_s"], "noisy": load["noisy"], "updates": update.updates,
                    "micro_batches": update.micro_batches, "loss": update.metrics.get("policy/loss"),
                    "weights": {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}}

        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            for mode in MODES:
                run = once(mode)
                runs[mode].append(run)
                print(f"{mode} #{repeat}: {run['seconds']:.1f} s, {run['updates']} updates in "
                      f"{run['micro_batches']} passes", flush=True)
    baseline, split = (runs[mode][-1]["weights"] for mode in MODES)
    weight_diff = max(float((baseline[name].float() - split[name].float()).abs().max()) for name in baseline)
    figures = {mode: {"seconds": [r["seconds"] for r in rs], "median_s": statistics.median(r["seconds"] for r in rs),
                      "padded_tokens": padded(plans[mode], lengths), "passes": len(plans[mode]),
                      "update_passes": rs[-1]["micro_batches"], "updates": rs[-1]["updates"], "loss": rs[-1]["loss"],
                      "noisy": any(r["noisy"] for r in rs)} for mode, rs in runs.items()}
    ratio = figures[MODES[1]]["median_s"] / figures[MODES[0]]["median_s"]
    precision = trainer.learner.cfg.perf.learner_precision  # as the trainer resolved auto on this machine
    body = [f"Machine: {machine()['cpu']}; model: {args.model or 'the labs cached student'}; one step's rollouts: "
            f"{args.tasks} tasks x {args.group} attempts ({len(trajectories)} episodes, {tokens} tokens), "
            f"minibatches of {args.minibatch} rows, algo.kl_coef={args.kl}, learner {precision}, "
            f"perf.micro_batch_tokens={budget}; {args.repeats} repeats a mode, alternating, each from the same "
            "weights and optimiser state.", "",
            "| plan | seconds, each repeat | median s | padded tokens, one pass over the batch | its passes | "
            "the updates' passes | policy loss | other processes above 10% of the CPUs |",
            "|---|---|---|---|---|---|---|---|"]
    for mode, f in figures.items():
        body.append(f"| {mode} | {', '.join(f'{s:.1f}' for s in f['seconds'])} | {f['median_s']:.1f} | "
                    f"{f['padded_tokens']} | {f['passes']} | {f['update_passes']} | {f['loss']:.6g} | "
                    f"{'yes' if f['noisy'] else 'no'} |")
    body += ["", f"Largest difference between the two modes' updated weights: {weight_diff:.3g}."]
    ratios = [Ratio("learner step: passes split by length / the fewest passes", ratio, 0.95,
                    higher_is_better=False, detail=f"median of {args.repeats} each")]
    write_section(args.out, Section(name="padding", title="A group's rows split into passes by length",
                                    markdown="\n".join(body), ratios=ratios, smoke=args.smoke,
                                    seconds=time.perf_counter() - started,
                                    data={"figures": figures, "model": step.model, "episodes": len(trajectories),
                                          "tokens": tokens, "weight_diff": weight_diff,
                                          "lengths": lengths,
                                          "group_ids": group_ids}))


if __name__ == "__main__":
    main()
