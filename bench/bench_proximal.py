"""The proximal log-probs of a step's first update from that update's own pass, against a no-grad
pass over every row: what the learner's step costs each way, and whether it updates the same.

With several minibatches a step (`train.minibatch_size` under the batch), pi_prox is the policy
the step started from. The rows of the first minibatch are updated on exactly those weights, so
their update's own forward pass, detached, gives it (`AdvantageStage`, `UpdateInputs.prox_own`);
the no-grad pass before the updates then scores only the later minibatches' rows. The baseline
scores every row there (as when a critic, a process reward model or a teacher needs the pass).

One RL step's rollouts of the SmolLM2 labs' shape (tasks x attempts, five turns, the coding
environment, at the rollout temperature) are sampled once from one model; then the learner's step
(`Trainer.advantages` and `Learner.update`) runs on them `--repeats` times a mode, the modes
alternating, each from the same weights and optimiser state. Figures: each mode's median
seconds, the ratio, the rows each no-grad pass scored, and the largest difference between the
two modes' updated weights (float rounding only: anything larger would be a different update).
The model is the labs' cached student (`keelrl.labs.common.cached_student` with the coding labs'
settings, made once per machine when it is not cached yet); `--model` takes another.

    python -m bench.bench_proximal                # the labs' student, 4 tasks x 4, minibatches of 8
    python -m bench.bench_proximal --smoke        # tiny model, seconds: checks the harness runs
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import Clock, Ratio, Section, arguments, machine, sampled_step, step_arguments, write_section

MODES = ("every row", "later minibatches")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = arguments(__doc__.split("\n\n")[0], out="proximal")
    step_arguments(parser, minibatch=8)
    args = parser.parse_args(argv)
    if args.smoke:
        args.model = args.model or "tiny"
        args.tasks, args.group, args.minibatch, args.repeats = 2, 2, 2, 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    import tempfile

    from keelrl.train import advantage as advantage_module

    scored: list[int] = []
    real_pass = advantage_module.chunked_token_logprobs

    def counted_pass(model: Any, input_ids: Any, *a: Any, **k: Any) -> Any:
        scored.append(int(input_ids.shape[0]))
        return real_pass(model, input_ids, *a, **k)

    advantage_module.chunked_token_logprobs = counted_pass  # type: ignore[assignment]
    with tempfile.TemporaryDirectory(prefix="keel-bench-proximal-") as scratch:
        step = sampled_step(args, Path(scratch) / "run", ["algo.kl_coef=0"])
        trainer, trajectories, batch, group_ids, first, tokens = (step.trainer, step.trajectories, step.batch,
                                                                  step.group_ids, step.first, step.tokens)

        def once(mode: str) -> dict[str, Any]:
            step.reset()
            scored.clear()
            clock = Clock()
            estimated = trainer.advantages(batch, first_update=first if mode == MODES[1] else ())
            update = trainer.learner.update(estimated.inputs, group_ids, 1)
            load = clock.read()
            return {"seconds": load["wall_s"], "noisy": load["noisy"], "scored": list(scored),
                    "updates": update.updates, "loss": update.metrics.get("policy/loss"),
                    "weights": {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}}

        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            for mode in MODES:
                run = once(mode)
                runs[mode].append(run)
                print(f"{mode} #{repeat}: {run['seconds']:.1f} s, {run['updates']} updates, no-grad pass over "
                      f"{run['scored']} rows", flush=True)
    advantage_module.chunked_token_logprobs = real_pass  # type: ignore[assignment]
    baseline, partial = (runs[mode][-1]["weights"] for mode in MODES)
    weight_diff = max(float((baseline[name].float() - partial[name].float()).abs().max()) for name in baseline)
    figures = {mode: {"seconds": [r["seconds"] for r in rs], "median_s": statistics.median(r["seconds"] for r in rs),
                      "scored": rs[-1]["scored"], "updates": rs[-1]["updates"], "loss": rs[-1]["loss"],
                      "noisy": any(r["noisy"] for r in rs)} for mode, rs in runs.items()}
    ratio = figures[MODES[1]]["median_s"] / figures[MODES[0]]["median_s"]
    precision = trainer.learner.cfg.perf.learner_precision  # as the trainer resolved auto on this machine
    body = [f"Machine: {machine()['cpu']}; model: {args.model or 'the labs cached student'}; one step's rollouts: "
            f"{args.tasks} tasks x {args.group} attempts ({len(trajectories)} episodes, {tokens} tokens), "
            f"minibatches of {args.minibatch} rows, learner {precision}; {args.repeats} repeats a mode, "
            "alternating, each from the same weights and optimiser state.", "",
            "| no-grad pass before the updates scores | seconds, each repeat | median s | rows scored | updates | "
            "policy loss | other processes above 10% of the CPUs |", "|---|---|---|---|---|---|---|"]
    for mode, f in figures.items():
        body.append(f"| {mode} | {', '.join(f'{s:.1f}' for s in f['seconds'])} | {f['median_s']:.1f} | "
                    f"{f['scored']} | {f['updates']} | {f['loss']:.6g} | {'yes' if f['noisy'] else 'no'} |")
    body += ["", f"Largest difference between the two modes' updated weights: {weight_diff:.3g}."]
    ratios = [Ratio("learner step: first update's own pi_prox / a no-grad pass over every row", ratio, 0.95,
                    higher_is_better=False, detail=f"median of {args.repeats} each")]
    write_section(args.out, Section(name="proximal", title="The first update's proximal log-probs from its own pass",
                                    markdown="\n".join(body), ratios=ratios, smoke=args.smoke,
                                    seconds=time.perf_counter() - started,
                                    data={"figures": figures, "model": step.model, "first_update": first,
                                          "episodes": len(trajectories), "tokens": tokens,
                                          "weight_diff": weight_diff}))


if __name__ == "__main__":
    main()
