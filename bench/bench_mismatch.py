"""A bf16 sampler against a float32 learner on the same tokens: the mismatch, and what each rollout correction does to it.

The sampler's log-probs mu are the behaviour policy of every importance ratio; the learner's
pi_prox are its log-probs of the same tokens under the same weights. vLLM and most RL stacks
sample in bf16 and learn in float32, so on fresh data pi_prox / mu is not 1
(keelrl.algos.corrections). What is measured, on SmolLM2-135M-Instruct (`--smoke`: the tiny
model, seconds):

1. prompts: the first `--prompts` held-out bundled coding tasks (`bundled_tasks("heldout")`),
   each its task text and files as one user message in the chat template;
2. completions: `--samples` per prompt, `--new-tokens` at most, temperature 1, drawn by
   `keelrl.inference.sample` from the model cast to bfloat16, and again with the same
   seed from the float32 model (the control);
3. the learner: `keelrl.policy.model.token_logprobs` of each completion under the float32 weights
   (no autocast), on the completion's own tokens;
4. per sampler, `mismatch_metrics` (mismatch/kl: mean log mu - log pi_prox, the sampled KL(mu ||
   pi_prox); mismatch/k3; the largest |log pi_prox - log mu|) and quantiles of |log ratio|; and per
   registered rollout correction at its default settings, what it does to the batch: tokens and
   sequences masked, weight mean and max, and the effective sample size (sum w)^2 / (n sum w^2)
   as a share of the n action tokens.

The ratio: the bf16 sampler's k3 mismatch over the float32 sampler's (whose is round-off of a
cached decode against a full pass, about 1e-7 or less): the metric tells a precision mismatch
from the noise floor by more than 10x. Nothing is trained; no time is measured.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

from bench.common import Clock, Ratio, Section, arguments, machine, write_section

QUANTILES = (0.5, 0.9, 0.99)


def parse_args(argv: list[str] | None = None) -> Any:
    parser = arguments(__doc__.split("\n\n")[0], out="mismatch")
    parser.add_argument("--model", default="smollm2", help="a registered model name or a model directory")
    parser.add_argument("--prompts", type=int, default=6, help="held-out coding tasks to prompt with")
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="most tokens per completion")
    parser.add_argument("--prompt-chars", type=int, default=3000, help="each prompt's text cut to this many characters")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.prompts, args.samples, args.new_tokens, args.prompt_chars = "tiny", 2, 2, 12, 300
    for name in ("prompts", "samples", "new_tokens", "prompt_chars"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def prompt_ids(tokenizer: Any, count: int, chars: int) -> list[list[int]]:
    """The first `count` held-out tasks, each its prompt and files (cut to `chars`) as a chat user turn."""
    from keelrl.envs.coding_tasks import bundled_tasks

    tasks = bundled_tasks("heldout")
    if count > len(tasks):
        raise ValueError(f"--prompts {count}: only {len(tasks)} held-out tasks are bundled")
    prompts = []
    for task in tasks[:count]:
        files = "\n\n".join(f"# {name}\n{text}" for name, text in task.files.items())
        content = f"{task.prompt}\n\n{files}"[:chars]
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts


def collate(contexts: list[list[int]], samples: list[Any], pad_id: int) -> dict[str, Any]:
    """Rows of context + completion, right-padded: input_ids, attention_mask, the completion's
    positions (the action mask) and the sampler's log-probs there, [B, T] each."""
    import torch

    width = max(len(c) + len(s.token_ids) for c, s in zip(contexts, samples))
    rows = len(samples)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros(rows, width, dtype=torch.long)
    action = torch.zeros(rows, width, dtype=torch.bool)
    behaviour = torch.zeros(rows, width, dtype=torch.float32)
    for row, (context, sample) in enumerate(zip(contexts, samples)):
        n, k = len(context), len(sample.token_ids)
        input_ids[row, :n + k] = torch.tensor(context + list(sample.token_ids))
        attention[row, :n + k] = 1
        action[row, n:n + k] = True
        behaviour[row, n:n + k] = torch.tensor(sample.logprobs, dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention, "action_mask": action, "behaviour": behaviour}


def measure(learner: Any, sampler: Any, tokenizer: Any, contexts: list[list[int]], args: Any,
            device: Any) -> dict[str, Any]:
    """One sampler's completions, the learner's log-probs of them, the mismatch and every correction."""
    import torch

    from keelrl.algos import ROLLOUT_CORRECTIONS, AlgoConfig, mismatch_metrics
    from keelrl.policy.model import token_logprobs
    from keelrl.inference import SamplingParams, sample

    rows = [context for context in contexts for _ in range(args.samples)]
    clock = Clock()
    samples = sample(sampler, tokenizer, rows, SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens,
                                                              stop=(), seed=args.seed))
    sampled = clock.read()
    batch = {key: value.to(device) for key, value in collate(rows, samples, tokenizer.pad_token_id).items()}
    mask = batch["action_mask"]
    with torch.no_grad():
        prox = token_logprobs(learner, batch["input_ids"], batch["attention_mask"], positions=mask)["logp"]
    cfg = AlgoConfig(preset="grpo", kl_coef=0.0)
    mismatch = {key: float(value) for key, value in mismatch_metrics(prox, batch["behaviour"], mask, cfg).items()}
    token_log_ratio = torch.where(mask, prox.double() - batch["behaviour"].double(), 0.0)  # [B, T]
    log_ratio = token_log_ratio[mask]  # [n]
    quantiles = torch.quantile(log_ratio.abs(), torch.tensor(QUANTILES, dtype=torch.float64, device=log_ratio.device))
    rows_with_tokens = mask.any(dim=1)
    row_sum = token_log_ratio.sum(dim=1)[rows_with_tokens]  # [b]: log of each sequence's ratio
    row_mean = (token_log_ratio.sum(dim=1) / mask.sum(dim=1).clamp(min=1))[rows_with_tokens]  # [b]: log geometric mean
    corrections = {}
    for name in ROLLOUT_CORRECTIONS:
        weights, metrics = ROLLOUT_CORRECTIONS.get(name)(prox, batch["behaviour"], mask,
                                                         AlgoConfig(preset="grpo", kl_coef=0.0, rollout_correction=name))
        kept = weights[mask].double()
        ess = float(kept.sum() ** 2 / (kept.numel() * (kept**2).sum())) if float((kept**2).sum()) > 0 else 0.0
        corrections[name] = {**{key.split("/", 1)[1]: float(value) for key, value in metrics.items()
                                if key.startswith("correction/")}, "effective_sample_frac": ess}
    return {"tokens": int(mask.sum()), "rows": len(rows), "sample_s": sampled["wall_s"],
            "noisy": sampled["noisy"], "mismatch": mismatch,
            "abs_log_ratio_quantiles": {str(q): float(v) for q, v in zip(QUANTILES, quantiles.tolist())},
            "sequence_ratio": sorted(math.exp(v) for v in row_sum.tolist()),
            "geometric_mean_ratio": sorted(math.exp(v) for v in row_mean.tolist()),
            "sampled_logprob_mean": float(batch["behaviour"][mask].double().mean()),
            "corrections": corrections,
            "completion_tokens": [len(s.token_ids) for s in samples]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from keelrl.policy.download import resolve_model_path
    from keelrl.policy.model import load_policy

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    started = time.perf_counter()
    path = str(resolve_model_path(args.model))  # a registered name is fetched on first use
    learner, tokenizer = load_policy(path, device=device, dtype=torch.float32)
    learner.eval()
    bf16 = copy.deepcopy(learner).to(torch.bfloat16)  # the same weights, rounded as a bf16 sampler holds them
    contexts = prompt_ids(tokenizer, args.prompts, args.prompt_chars)
    results = {}
    for precision, sampler in (("float32", learner), ("bfloat16", bf16)):
        results[precision] = measure(learner, sampler, tokenizer, contexts, args, device)
        m = results[precision]["mismatch"]
        print(f"{precision} sampler: {results[precision]['tokens']} tokens, kl {m['mismatch/kl']:.3g}, "
              f"k3 {m['mismatch/k3']:.3g}, max |log ratio| {m['mismatch/log_ratio_abs_max']:.3g}", flush=True)
    write_section(args.out, summarise(results, args, str(device), time.perf_counter() - started))
    print(f"wrote {args.out / 'section.json'}")


def summarise(results: dict[str, dict[str, Any]], args: Any, device: str, seconds: float) -> Section:
    model = "the tiny model" if args.model == "tiny" else args.model
    lines = [f"{model} on {device}: {args.prompts} held-out coding prompts x {args.samples} completions of at most "
             f"{args.new_tokens} tokens (temperature 1), sampled by the model in each precision with the same seed; "
             "the learner's log-probs of the same tokens in float32. mismatch/kl = mean of log mu - log pi_prox "
             "(the sampled KL(mu || pi_prox); can be negative on few tokens), k3 = mean of (rho - 1) - log rho.", "",
             "| sampler | action tokens | mismatch/kl | mismatch/k3 | max abs log ratio | abs log ratio p50 / p90 / p99 |",
             "|---|---|---|---|---|---|"]
    for precision, result in results.items():
        m, q = result["mismatch"], result["abs_log_ratio_quantiles"]
        lines.append(f"| {precision} | {result['tokens']} | {m['mismatch/kl']:.3g} | {m['mismatch/k3']:.3g} "
                     f"| {m['mismatch/log_ratio_abs_max']:.3g} | {q['0.5']:.2g} / {q['0.9']:.2g} / {q['0.99']:.2g} |")
    spread = results["bfloat16"]
    lines += ["", f"Per sequence of the bf16 sampler (min / median / max): the ratio prod pi_prox / mu "
              f"{_range(spread['sequence_ratio'])}, its geometric mean {_range(spread['geometric_mean_ratio'], 4)}."]
    lines += ["", "What each rollout correction (`algo.rollout_correction`, default settings) does to the bf16 "
              "sampler's batch (the float32 sampler's in brackets):", "",
              "| correction | tokens masked | sequences masked | weight mean | weight max | effective sample share |",
              "|---|---|---|---|---|---|"]
    bf16, fp32 = results["bfloat16"]["corrections"], results["float32"]["corrections"]
    for name in bf16:
        b, f = bf16[name], fp32[name]
        lines.append(f"| `{name}` | {b['masked_token_frac']:.3f} ({f['masked_token_frac']:.3f}) "
                     f"| {b['masked_seq_frac']:.3f} ({f['masked_seq_frac']:.3f}) "
                     f"| {b['weight_mean']:.4f} ({f['weight_mean']:.4f}) | {b['weight_max']:.3f} ({f['weight_max']:.3f}) "
                     f"| {b['effective_sample_frac']:.4f} ({f['effective_sample_frac']:.4f}) |")
    floor = 1e-15
    bf16_k3, fp32_k3 = results["bfloat16"]["mismatch"]["mismatch/k3"], results["float32"]["mismatch"]["mismatch/k3"]
    ratio = bf16_k3 / max(fp32_k3, floor)
    detail = (f"k3 {bf16_k3:.3g} (bf16 sampler) / {fp32_k3:.3g} (float32 sampler)"
              + (f", the denominator floored at {floor:g}" if fp32_k3 < floor else ""))
    lines += ["", f"bf16 / float32 sampler mismatch (k3): {ratio:.3g} ({detail})."]
    if args.smoke:
        lines.append("Smoke size: the tiny random model's numbers measure nothing.")
    ratios = [Ratio("mismatch KL (k3), bf16 sampler / float32 sampler", ratio if math.isfinite(ratio) else float("nan"),
                    10.0, detail=detail)]
    return Section(name="mismatch", title="Sampler/learner precision mismatch", markdown="\n".join(lines),
                   ratios=ratios, smoke=args.smoke, seconds=seconds,
                   data={"results": results, "settings": vars(args) | {"out": str(args.out)}, "machine": machine()})


def _range(values: list[float], digits: int = 3) -> str:
    ordered = sorted(values)
    return f"{ordered[0]:.{digits}f} / {ordered[len(ordered) // 2]:.{digits}f} / {ordered[-1]:.{digits}f}"


if __name__ == "__main__":
    main()
