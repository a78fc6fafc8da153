"""One GRPO step, end to end, in keelrl and in TRL's GRPOTrainer: completion tokens per second.

Both libraries train the same model from the same weights on the same prompts, in the same
order, single-turn (one completion per prompt, then a reward), with the same group size,
completion length, loss, optimiser and learning rate:

- model: `--models` (SmolLM2-135M-Instruct from the registry, and the tiny random model),
  float32 on the CPU (what keelrl picks on a CPU without AMX, and TRL's default);
- prompts: `--prompts` per step, each a held-out coding task's prompt and files as the user
  message of the model's chat template, cut to about `--prompt-tokens` tokens
  (`bench.bench_sampler.build_prompts`); step s uses prompts s*P .. s*P+P-1 for both;
- sampling: `--group` completions per prompt at temperature 1, top-p 1, exactly
  `--completion-tokens` tokens each (both get `min_new_tokens` = max; keelrl's sampler has no
  stop string here), counted from each library's own output;
- reward: the same pure function of the completion text for both (`reward_of`: the share of
  its characters that are letters or spaces), so groups have a spread and the loss a gradient;
- loss: GRPO, advantages normalised by the group's std, PPO clip 0.2, no KL (TRL
  `loss_type="grpo", beta=0, num_iterations=1, scale_rewards="group"`; keelrl
  `algo.preset=grpo`), one update per step on all P x G completions, AdamW at `--lr`, no
  weight decay, gradient clipping at 1, no gradient checkpointing.

Each library runs in its own process (`--worker`), one after the other, `--steps` steps; the
first is a warm-up and not counted. Per step: the wall time of the whole step (sampling,
reward, learning), and of the learner alone (keelrl: `time/learn_s`, from collating the batch
to the optimiser step; TRL: the step less its `_generate_and_score_completions`, which
samples, scores and builds the batch). Completion tokens per second = P x G x length / time.
The ratio is keelrl's tokens/s over TRL's (min/median/max over the timed steps; the headline is
the ratio of medians).

What differs by design, and is reported, not hidden: keelrl prefills a group's shared prompt
once for its G completions and runs the learner's shared prompt once per group
(`perf.share_prefix`); TRL runs every row's prompt in full. keelrl also computes its
behaviour log-probs while sampling. Neither side runs a reference model (beta = 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

from bench.common import Clock, Ratio, Section, arguments, fmt_spread, machine, read_worker_spec, run_worker, write_section
from bench.synthetic import base_overrides, reward_of, scratch_dir, synthetic_trainer

LIBRARIES = ("keelrl", "trl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = arguments(__doc__.split("\n\n")[0], out="trl")
    parser.add_argument("--models", nargs="+", default=["smollm2", "tiny"], help="registered names or model dirs")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (GRPO's G)")
    parser.add_argument("--completion-tokens", type=int, default=96, help="tokens per completion, exactly")
    parser.add_argument("--prompt-tokens", type=int, default=300, help="prompt length, about (template included)")
    parser.add_argument("--steps", type=int, default=3, help="steps per library; the first is a warm-up")
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate for both")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one library's run, as JSON
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.prompts, args.group, args.completion_tokens, args.prompt_tokens, args.steps = (
            ["tiny"], 2, 2, 8, 48, 2)
    for name in ("prompts", "group", "completion_tokens", "prompt_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.group < 2:
        parser.error(f"--group must be >= 2 (a group baseline needs two completions), got {args.group}")
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (one warm-up and at least one timed step), got {args.steps}")
    return args


def prompt_texts(tokenizer: Any, count: int, target: int) -> list[str]:
    """`count` user messages of about `target` tokens in the chat template (the first P are step 1's)."""
    from bench.bench_sampler import build_prompts

    messages = []
    for ids in build_prompts(tokenizer, count, target):
        rendered = tokenizer.decode(ids)
        messages.append(rendered)
    return [_user_content(tokenizer, text) for text in messages]


def _user_content(tokenizer: Any, rendered: str) -> str:
    """The user message inside a rendered one-message chat (template text around it removed)."""
    marker = "\x00CONTENT\x00"
    template = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                             add_generation_prompt=True)
    head, tail = template.split(marker)
    if not (rendered.startswith(head) and rendered.endswith(tail)):
        raise RuntimeError("prompt does not have the chat template's shape")
    return rendered[len(head):len(rendered) - len(tail)]


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt's token ids in the chat template, as both libraries render it."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# --------------------------------------------------------------------------- keelrl
def run_keelrl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    P, G, L, steps, texts = spec["prompts"], spec["group"], spec["completion_tokens"], spec["steps"], spec["texts"]
    rows: list[dict[str, Any]] = []
    with scratch_dir() as run_dir:
        overrides = base_overrides(spec["model"], run_dir, prompts=P, group=G, completion_tokens=L, steps=steps,
                                   lr=spec["lr"])
        trainer = synthetic_trainer(overrides, texts,
                                    progress=lambda event, info: rows.append(info) if event == "step" else None)
        prompt_tokens = [len(prompt_ids(trainer.tokenizer, [{"role": "user", "content": t}])) for t in texts[:P * steps]]
        clock = Clock()
        trainer.run()
        load = clock.read()
    return {"steps": [{"step_s": r["time/step_s"], "learn_s": r["time/learn_s"],
                       "completion_tokens": r["train/action_tokens"] * P * G, "reward": r["train/reward"]}
                      for r in rows],
            "prompt_tokens_mean": statistics.mean(prompt_tokens), "other_cpu_share": load["other_cpu_share"],
            "torch_threads": torch.get_num_threads()}


# --------------------------------------------------------------------------- TRL
def run_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from keelrl.policy.model import load_policy

    P, G, L, steps = spec["prompts"], spec["group"], spec["completion_tokens"], spec["steps"]
    model, tokenizer = load_policy(spec["model"], "cpu", dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": t}]} for t in spec["texts"][:P * steps]])

    def reward(completions: list[Any], **_: Any) -> list[float]:
        return [reward_of(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    timings: list[dict[str, float]] = []
    generation: list[float] = []
    lengths: list[int] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.started = time.perf_counter()
            generation.clear()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step_s = time.perf_counter() - self.started
            timings.append({"step_s": step_s, "learn_s": step_s - sum(generation),
                            "completion_tokens": float(sum(lengths[-P * G:]))})

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=P * G, gradient_accumulation_steps=1, num_generations=G,
            max_completion_length=L, generation_kwargs={"min_new_tokens": L}, temperature=1.0, top_p=1.0, top_k=0,
            learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=1.0, beta=0.0, loss_type="grpo", scale_rewards="group", num_iterations=1, epsilon=0.2,
            max_steps=steps, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
            gradient_checkpointing=False, shuffle_dataset=False, seed=0, disable_tqdm=True,
            dataloader_num_workers=0, optim="adamw_torch",
        )
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward, args=config,
                              train_dataset=dataset, callbacks=[StepTimer()])
        inner = trainer._generate_and_score_completions

        def timed(*a: Any, **k: Any) -> Any:
            started = time.perf_counter()
            out_batch = inner(*a, **k)
            generation.append(time.perf_counter() - started)
            lengths.extend(int(n) for n in out_batch["completion_mask"].sum(-1).tolist())
            return out_batch

        trainer._generate_and_score_completions = timed  # type: ignore[method-assign]
        prompt_tokens = [len(prompt_ids(tokenizer, row["prompt"])) for row in dataset]
        clock = Clock()
        trainer.train()
        load = clock.read()
    return {"steps": timings, "prompt_tokens_mean": statistics.mean(prompt_tokens),
            "other_cpu_share": load["other_cpu_share"], "torch_threads": torch.get_num_threads()}


# --------------------------------------------------------------------------- driver
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        spec = read_worker_spec(args.worker)
        import torch

        if spec["threads"] > 0:
            torch.set_num_threads(spec["threads"])
        result = (run_keelrl if spec["library"] == "keelrl" else run_trl)(spec)
        print(json.dumps(result))
        return
    from keelrl.policy.model import load_policy

    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for model in args.models:
        _, tokenizer = load_policy(model, "cpu")
        texts = prompt_texts(tokenizer, args.prompts * args.steps, args.prompt_tokens)
        results[model] = {}
        for library in LIBRARIES:
            spec = {"library": library, "model": model, "texts": texts, "prompts": args.prompts, "group": args.group,
                    "completion_tokens": args.completion_tokens, "steps": args.steps, "lr": args.lr,
                    "threads": args.threads}
            print(f"[{model}] {library}: {args.steps} steps of {args.prompts} x {args.group} x "
                  f"{args.completion_tokens} tokens", flush=True)
            run = run_worker("bench.bench_trl", spec, f"{library} on {model}")
            expected = args.prompts * args.group * args.completion_tokens
            for number, step in enumerate(run["steps"], 1):
                if round(step["completion_tokens"]) != expected:
                    raise RuntimeError(f"{library} step {number} generated {step['completion_tokens']} completion "
                                       f"tokens, not {expected}")
                print(f"[{model}] {library} step {number}: {step['step_s']:.2f} s (learner {step['learn_s']:.2f} s)",
                      flush=True)
            results[model][library] = run
    write_section(args.out, summarise(results, args, time.perf_counter() - started))
    print(f"wrote {args.out / 'section.json'}")


def summarise(results: dict[str, dict[str, Any]], args: argparse.Namespace, seconds: float) -> Section:
    tokens = args.prompts * args.group * args.completion_tokens
    lines = [f"Per step: {args.prompts} prompts x {args.group} completions x exactly {args.completion_tokens} tokens "
             f"= {tokens} completion tokens; prompts about {args.prompt_tokens} tokens; float32, CPU; "
             f"{args.steps - 1} timed steps after one warm-up; tokens/s as median (min-max, n).", "",
             "| model | library | prompt tokens (mean) | step s | step tok/s | learner s | learner tok/s "
             "| other CPU share |", "|---|---|---|---|---|---|---|---|"]
    ratios = []
    for model, runs in results.items():
        medians = {}
        for library in LIBRARIES:
            run = runs[library]
            timed = run["steps"][1:]
            step_rate = [tokens / s["step_s"] for s in timed]
            learn_rate = [tokens / s["learn_s"] for s in timed]
            medians[library] = (statistics.median(step_rate), statistics.median(learn_rate))
            lines.append(f"| {model} | {library} | {run['prompt_tokens_mean']:.0f} "
                         f"| {fmt_spread([s['step_s'] for s in timed])} | {fmt_spread(step_rate, 1)} "
                         f"| {fmt_spread([s['learn_s'] for s in timed])} | {fmt_spread(learn_rate, 1)} "
                         f"| {run['other_cpu_share']:.0%} |")
        keel, trl = medians["keelrl"], medians["trl"]
        per_step = [k["step_s"] for k in runs["keelrl"]["steps"][1:]], [t["step_s"] for t in runs["trl"]["steps"][1:]]
        ratios.append(Ratio(f"{model}: full step tokens/s, keelrl / TRL", keel[0] / trl[0], 1.5,
                            detail=f"ratio of medians; keelrl {keel[0]:.1f}, TRL {trl[0]:.1f} tok/s; per-step s "
                                   f"keelrl {per_step[0]}, TRL {per_step[1]}"))
        ratios.append(Ratio(f"{model}: learner tokens/s, keelrl / TRL", keel[1] / trl[1], 1.5,
                            detail=f"ratio of medians; keelrl {keel[1]:.1f}, TRL {trl[1]:.1f} tok/s"))
    lines += ["", "Ratios (keelrl / TRL, of the median tokens/s):", ""]
    lines += [f"- {r.name}: **{r.value:.2f}x** (target >= {r.target:g}x)" for r in ratios]
    return Section(name="trl", title="End-to-end GRPO step against TRL", markdown="\n".join(lines), ratios=ratios,
                   smoke=args.smoke, seconds=seconds, data={"results": results, "machine": machine(),
                                                            "settings": vars(args) | {"out": str(args.out)}})


if __name__ == "__main__":
    main()
