"""Policy, sampling and the agent loop with the tiny model."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import limits
from keelrl.envs.coding import CodingEnv
from keelrl.envs.teacher import ScriptedTeacher
from keelrl.policy.model import ValueHead, load_policy, token_logprobs
from keelrl.policy.chat import ChatFormat, ChatTemplateError
from keelrl.inference import SamplingParams, draw_uniforms, end_token_ids, sample
from keelrl.policy.tiny import build_tiny_tokenizer
from keelrl.rollout.agent_loop import model_actor, run_episodes, scripted_actor
from keelrl.rollout.scheduler import observation_tokens, prompt_tokens
from keelrl.rollout.trajectory import Trajectory, collate
from task_fixtures import retry_task


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_policy(str(tiny_model_dir), "cpu")


def test_tokenizer_round_trips_any_text_and_has_the_chat_template(tmp_path):
    tokenizer = build_tiny_tokenizer()
    text = 'def retry_count(config):\n    return config.get("retries") or 3  # é ✓\t'
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert len(tokenizer(text)["input_ids"]) == len(text.encode())  # one token per byte
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|user|>hi<|end|><|assistant|>"
    tokenizer.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text)["input_ids"] == tokenizer(text)["input_ids"] and len(again) == len(tokenizer)


def test_chunked_logprobs_and_entropy_equal_the_naive_computation(tiny):
    model, _ = tiny
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (3, 41), generator=generator)
    attention = torch.ones_like(ids)
    attention[2, 30:] = 0  # right padding
    chunked = token_logprobs(model, ids, attention, chunk_size=7, with_entropy=True)
    logits = model(input_ids=ids, attention_mask=attention).logits.float()
    log_probs = torch.log_softmax(logits[:, :-1], -1)
    naive = log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(chunked["logp"][:, 1:], naive, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked["entropy"][:, 1:], -(log_probs.exp() * log_probs).sum(-1), rtol=1e-5, atol=1e-5)
    assert torch.equal(chunked["logp"][:, 0], torch.zeros(3))


def test_value_head_stop_gradient_keeps_the_value_loss_off_the_body(tiny):
    model, _ = tiny
    ids = torch.randint(0, 256, (2, 12))
    for stop, body_gets_grad in ((True, False), (False, True)):
        model.zero_grad(set_to_none=True)
        head = ValueHead(model.config.hidden_size, stop_gradient=stop)
        torch.nn.init.normal_(head.linear.weight)
        hidden = token_logprobs(model, ids, torch.ones_like(ids), with_hidden=True)["hidden"]
        head(hidden).pow(2).mean().backward()
        body_grad = model.model.layers[0].mlp.up_proj.weight.grad
        assert (body_grad is not None and body_grad.abs().sum() > 0) == body_gets_grad
        assert head.linear.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9)])
def test_behaviour_logprobs_are_those_of_the_distribution_sampled_from(tiny, temperature, top_p):
    model, tokenizer = tiny
    contexts = [tokenizer("<|user|>fix it<|end|><|assistant|>")["input_ids"],
                tokenizer("<|user|>a longer request<|end|><|assistant|>")["input_ids"]]
    samples = sample(model, tokenizer, contexts, SamplingParams(temperature, top_p, max_new_tokens=12, seed=3))
    for context, drawn in zip(contexts, samples):
        sequence = torch.tensor([context + drawn.token_ids])
        logits = model(input_ids=sequence).logits[0, len(context) - 1:-1].float() / temperature
        if top_p < 1.0:  # nucleus: keep the smallest prefix of sorted tokens reaching top_p
            sorted_logits, order = logits.sort(-1, descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            drop = cumulative - sorted_logits.softmax(-1) > top_p
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(drawn.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(drawn.logprobs), expected, rtol=1e-4, atol=1e-4)


def test_rows_with_one_context_share_its_prefill_and_sample_as_without(tiny, monkeypatch):
    """A group's attempts at one prompt prefill it once: the same tokens and behaviour log-probs
    as prefilling every row, each row still from its own uniforms."""
    from keelrl.inference import hf as sampling_module

    model, tokenizer = tiny
    short = tokenizer("<|user|>fix it<|end|><|assistant|>")["input_ids"]
    long = tokenizer("<|user|>a longer request, padded less<|end|><|assistant|>")["input_ids"]
    contexts = [short, long, short, long, long, tokenizer("<|user|>alone<|end|><|assistant|>")["input_ids"]]
    uniforms = draw_uniforms(torch.Generator().manual_seed(11), 6 * 16).view(6, 16)
    prefills = []
    original = sampling_module._shared_prefill
    monkeypatch.setattr(sampling_module, "_shared_prefill",
                        lambda *args: prefills.append(original(*args)) or prefills[-1])
    config = SamplingParams(temperature=0.9, max_new_tokens=16, stop=())
    shared = sample(model, tokenizer, contexts, config, uniforms=uniforms)
    assert len(prefills) == 1 and prefills[0], "the duplicated contexts were not prefilled once"
    cache = next(iter(prefills[0].values()))
    assert cache.layers[0].keys.shape[0] == 6  # (generate has since grown it past the prefilled contexts)
    plain = sample(model, tokenizer, contexts, config, uniforms=uniforms, share_prompts=False)
    assert [s.token_ids for s in shared] == [p.token_ids for p in plain]
    for got, want in zip(shared, plain):
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-5)
    assert shared[0].token_ids != shared[2].token_ids or shared[1].token_ids != shared[3].token_ids  # own uniforms
    assert sampling_module._shared_prefill(model, torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
                                           [[1, 1, 1], [1, 1, 2]]) == {}  # nothing shared: nothing prefilled


@pytest.fixture(scope="module")
def tiny_pad_is_eos(tiny_model_dir):
    """The tiny model with its tokenizer's pad token set to its end-of-turn token, as SmolLM2's is."""
    model, tokenizer = load_policy(str(tiny_model_dir), "cpu")
    tokenizer.pad_token = "<|end|>"
    return model, tokenizer


def test_fresh_ratios_are_one_and_the_end_token_is_kept_when_pad_is_the_end_token(tiny_pad_is_eos):
    model, tokenizer = tiny_pad_is_eos
    end = tokenizer.pad_token_id
    assert end in end_token_ids(tokenizer)
    contexts = [prompt_tokens(tokenizer, f"request {i}" * (i + 1)) for i in range(8)]
    ended = []
    for seed in range(20):  # until some row ends on the end token (a few % per token here)
        samples = sample(model, tokenizer, contexts, SamplingParams(1.0, 1.0, max_new_tokens=48, stop=(), seed=seed))
        ended = [(c, s) for c, s in zip(contexts, samples) if s.token_ids and s.token_ids[-1] == end]
        if ended:
            break
    assert ended, "no sample ended on the end token in 20 seeds"
    for context, drawn in zip(contexts, samples):
        # A row is cut after its first end token and holds no other: nothing after it, no padding.
        assert end not in drawn.token_ids[:-1]
        assert (drawn.stopped == "stop") == (bool(drawn.token_ids) and drawn.token_ids[-1] == end)
    trajectories = [Trajectory(task_id="t", group_id=0) for _ in samples]
    for trajectory, context, drawn in zip(trajectories, contexts, samples):
        trajectory.extend(context, action=False, turn=0)
        trajectory.extend(drawn.token_ids, action=True, turn=0, logprobs=drawn.logprobs)
    batch = collate(trajectories, end)  # right-padded with the end token: the mask tells them apart
    logp = token_logprobs(model, batch.input_ids, batch.attention_mask)["logp"]
    ratio = torch.exp(logp - batch.behaviour_logprobs)[batch.action_mask]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=2e-5)
    for context, drawn in ended:  # the end token is an action token the learner trains on
        assert drawn.token_ids[-1] == end and len(drawn.logprobs) == len(drawn.token_ids)



def test_learner_logprobs_at_the_sampling_temperature_make_fresh_ratios_one(tiny):
    """Samples drawn at T=0.7: the learner's log-probs at the same temperature give ratio 1 on
    every action token (the behaviour policy is the tempered one); at T=1 they do not."""
    model, tokenizer = tiny
    contexts = [prompt_tokens(tokenizer, f"request {i}" * (i + 1)) for i in range(4)]
    samples = sample(model, tokenizer, contexts, SamplingParams(0.7, 1.0, max_new_tokens=24, stop=(), seed=5))
    trajectories = [Trajectory(task_id="t", group_id=0) for _ in samples]
    for trajectory, context, drawn in zip(trajectories, contexts, samples):
        trajectory.extend(context, action=False, turn=0)
        trajectory.extend(drawn.token_ids, action=True, turn=0, logprobs=drawn.logprobs)
    batch = collate(trajectories, 0)
    mask = batch.action_mask
    tempered = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=0.7)["logp"]
    ratio = torch.exp(tempered - batch.behaviour_logprobs)[mask]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=2e-5)
    at_action = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=0.7, positions=mask)["logp"]
    torch.testing.assert_close(at_action[mask], tempered[mask], rtol=0, atol=1e-6)
    untempered = token_logprobs(model, batch.input_ids, batch.attention_mask)["logp"]
    assert (torch.exp(untempered - batch.behaviour_logprobs)[mask] - 1).abs().max() > 0.05
    # float64 reference: log_softmax(logits / T) at each action token
    logits = copy.deepcopy(model).double()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    expected = torch.log_softmax(logits[:, :-1] / 0.7, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(tempered[:, 1:][mask[:, 1:]].double(), expected[mask[:, 1:]], rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=0.0)


def test_chat_format_is_read_from_the_template(tiny):
    _, tokenizer = tiny
    chat = ChatFormat.of(tokenizer)
    assert (chat.observation_open, chat.observation_close, chat.turn_end) == \
        ("<|end|><|tool|>", "<|end|><|assistant|>", "<|end|>")
    assert chat.observation_role == "tool"
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    assert end in chat.end_token_ids and tokenizer.eos_token_id in chat.end_token_ids
    text = tokenizer.decode(observation_tokens(tokenizer, "OBS"))
    assert text == "<|end|><|tool|>OBS<|end|><|assistant|>"
    # after an action that already ended its turn, the end token is not repeated
    assert tokenizer.decode(observation_tokens(tokenizer, "OBS", [65, end])) == "<|tool|>OBS<|end|><|assistant|>"


def _chatml_tokenizer():
    """The tiny byte tokenizer with a ChatML template (SmolLM2's layout) and <|im_end|> as eos and pad."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = (
        "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
        "<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
        "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|im_end|>"
    return tokenizer


def test_a_whole_episode_is_rendered_in_the_models_chat_template():
    """Prompt, actions and observations laid out turn by turn give exactly the text the template
    renders for the whole conversation, whether or not an action ended its own turn."""
    tokenizer = _chatml_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    chat = ChatFormat.of(tokenizer)
    assert chat.turn_end == "<|im_end|>\n" and chat.end_token_ids == (end,)
    assert chat.observation_open == "<|im_end|>\n<|im_start|>tool\n"
    actions = ['<call>read</call>', '<call>test</call>', '<call>submit</call>']
    observations = ["def f(): ...", "1 failed"]
    for ends_turn in (False, True):
        tokens = prompt_tokens(tokenizer, "Fix the bug.")
        for i, action in enumerate(actions[:-1]):
            action_ids = tokenizer(action, add_special_tokens=False)["input_ids"] + ([end] if ends_turn else [])
            tokens += action_ids + observation_tokens(tokenizer, observations[i], action_ids)
        tokens += tokenizer(actions[-1], add_special_tokens=False)["input_ids"]
        messages = [{"role": "user", "content": "Fix the bug."}]
        for action, observation in zip(actions, observations):
            messages += [{"role": "assistant", "content": action}, {"role": "tool", "content": observation}]
        messages.append({"role": "assistant", "content": actions[-1]})
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        assert rendered.startswith(tokenizer.decode(tokens))
        assert rendered == tokenizer.decode(tokens) + "<|im_end|>\n"


def test_a_tokenizer_without_a_chat_template_gets_an_error_saying_so():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        prompt_tokens(tokenizer, "hi")


def test_an_episode_that_would_outgrow_the_context_ends_with_context_limit_untruncated(tiny):
    model, tokenizer = tiny
    task = retry_task()
    teacher = ScriptedTeacher(success_rate=1.0, mistake_rate=0.0, seed=0)
    prompt_length = len(prompt_tokens(tokenizer, CodingEnv().reset(task)))
    limit = prompt_length + 200
    cfg = limits(max_turns=8, max_context_tokens=limit, max_new_tokens=40)
    [trajectory] = run_episodes(lambda: CodingEnv(), [task], tokenizer,
                                scripted_actor(tokenizer, [teacher.policy(task)]), cfg)
    assert trajectory.termination == "context_limit"
    assert len(trajectory.token_ids) + 40 <= limit + 1000  # ended by the check, not cut anywhere
    assert len(trajectory.token_ids) == len(trajectory.action_mask) == len(trajectory.behaviour_logprobs)
    too_small = limits(max_context_tokens=prompt_length + 10, max_new_tokens=40)
    [unstarted] = run_episodes(lambda: CodingEnv(), [task], tokenizer,
                               scripted_actor(tokenizer, [teacher.policy(task)]), too_small)
    assert unstarted.termination == "context_limit" and unstarted.actions == []


def test_agent_loop_keeps_generated_token_ids_without_retokenising(tiny):
    model, tokenizer = tiny
    # Bytes that are not valid UTF-8 decode to U+FFFD and would re-encode to different ids.
    raw = [0xE2, 0x82, 0x41] + tokenizer("<call>read</call>", add_special_tokens=False)["input_ids"]
    assert tokenizer(tokenizer.decode(raw), add_special_tokens=False)["input_ids"] != raw

    def act(active):
        return [(list(raw), [-0.5] * len(raw), tokenizer.decode(raw)) for _ in active]

    task = retry_task()
    [trajectory] = run_episodes(lambda: CodingEnv(max_turns=2, use_git=False), [task], tokenizer, act,
                                limits(max_turns=2), version=7)
    ids, mask = trajectory.token_ids, trajectory.action_mask
    action_positions = [i for i, m in enumerate(mask) if m]
    assert len(action_positions) == 2 * len(raw)
    assert [ids[i] for i in action_positions] == raw + raw
    assert [trajectory.behaviour_logprobs[i] for i in action_positions] == [-0.5] * (2 * len(raw))
    assert all(trajectory.behaviour_logprobs[i] == 0.0 for i, m in enumerate(mask) if not m)
    assert trajectory.versions == [7, 7] and trajectory.termination == "max_turns"
    assert sorted(set(trajectory.turn_ids)) == [0, 1]
    assert trajectory.observations[0].startswith("retry.py\n1| def retry_count")


def test_teacher_demonstrations_and_model_rollouts_collate_into_aligned_tensors(tiny):
    model, tokenizer = tiny
    task = retry_task()
    teacher = ScriptedTeacher(success_rate=1.0, mistake_rate=1.0, seed=0)
    demos = run_episodes(lambda: CodingEnv(max_turns=8), [task, task], tokenizer,
                         scripted_actor(tokenizer, [teacher.policy(task), teacher.policy(task)]), limits())
    assert all(d.success and d.reward == 1.0 for d in demos)
    assert "FAIL test_none" in demos[0].observations[2]  # the lecture's mistake, then recovery
    rollouts = run_episodes(lambda: CodingEnv(max_turns=2, use_git=False), [task] * 3, tokenizer,
                            model_actor(model, tokenizer, SamplingParams(max_new_tokens=8)),
                            limits(max_turns=2), group_ids=[5, 5, 5], seed=1)
    batch = collate(demos + rollouts, tokenizer.pad_token_id)
    for row, trajectory in enumerate(demos + rollouts):
        n = len(trajectory.token_ids)
        assert batch.input_ids[row, :n].tolist() == trajectory.token_ids
        assert batch.action_mask[row, :n].tolist() == trajectory.action_mask
        assert not batch.action_mask[row, n:].any() and not batch.attention_mask[row, n:].any()
    assert batch.group_ids.tolist() == [0, 1, 5, 5, 5]
    assert batch.rewards[:2].tolist() == [1.0, 1.0]


def test_the_own_mistakes_round_continues_the_students_failing_edits_with_their_edit_masked(tiny):
    from keelrl.train.warm_start import own_mistake_demos

    _, tokenizer = tiny
    task = retry_task()
    wrong = '<call>replace 2\n    return config.get("retries", 3)\n</call>'
    fixed = ('<call>replace 2\n    value = config.get("retries")\n    if value is None:\n'
             '        return 3\n    return value\n</call>')
    firsts = [wrong, fixed, "<call>test</call>", wrong]  # the student's first actions, one task each

    def student(index: int):
        return lambda prompt, turns: firsts[index] if not turns else "<call>submit</call>"

    teacher = ScriptedTeacher(success_rate=1.0, mistake_rate=0.0, seed=0)
    demos, continued = own_mistake_demos(teacher, [task] * 4, lambda: CodingEnv(max_turns=5, use_git=False),
                                         limits(max_turns=5), tokenizer,
                                         scripted_actor(tokenizer, [student(i) for i in range(4)]))
    assert continued == 2 and len(demos) == 2  # the two wrong edits; the fix and the test are left alone
    for demo in demos:
        assert demo.success and demo.actions[:4] == [wrong, "<call>test</call>", fixed, "<call>test</call>"]
        learned = {turn for turn, m in zip(demo.turn_ids, demo.action_mask) if m}
        assert learned == {1, 2, 3, 4}  # the student's own edit (turn 0) is context only
    # a continuation of five actions (edit, test, fix, test, submit) does not fit four turns: skipped
    short = own_mistake_demos(teacher, [task] * 4, lambda: CodingEnv(max_turns=4, use_git=False),
                              limits(max_turns=4), tokenizer,
                              scripted_actor(tokenizer, [student(i) for i in range(4)]))
    assert short == ([], 0)


@pytest.mark.parametrize("kind", ["head", "separate", "success_token"])
def test_every_critic_gives_aligned_values_and_trains_only_what_it_should(tiny, kind, tmp_path):
    from keelrl.policy.critic import build_critic

    model, tokenizer = tiny
    path = tmp_path / "policy"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    critic = build_critic(kind, model, tokenizer, model_path=str(path), device=torch.device("cpu"),
                          stop_gradient=True)
    if kind != "success_token":  # value heads start at zero; give the body a gradient path
        torch.nn.init.normal_(critic.head.linear.weight)
    ids = torch.randint(0, 256, (2, 9))
    attention = torch.ones_like(ids)
    model.zero_grad(set_to_none=True)
    hidden = token_logprobs(model, ids, attention, with_hidden=True)["hidden"]
    values = critic(ids, attention, hidden)
    assert values.shape == (2, 9) and torch.isfinite(values).all()
    assert torch.equal(values[:, 0], values[:, 1])  # the first two tokens share the empty-ish history
    if kind == "success_token":
        assert ((values > 0) & (values < 1)).all()
    (values - 1.0).pow(2).mean().backward()
    policy_body_grad = model.model.layers[0].mlp.up_proj.weight.grad
    policy_gets_grad = policy_body_grad is not None and bool(policy_body_grad.abs().sum() > 0)
    assert policy_gets_grad == (kind == "success_token")  # head: stop-gradient; separate: its own body
    if kind == "separate":
        assert critic.body.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0


def test_rejected_actions_are_counted_per_trajectory(tiny):
    from keelrl.envs.guess import GuessEnv, GuessTask

    _, tokenizer = tiny
    script = ["<call>guess 0</call>", "<call>guess 3</call>", "no call at all", "<call>guess 9</call>"]
    [trajectory] = run_episodes(lambda: GuessEnv(max_turns=4), [GuessTask("g", secret=9, n=16)], tokenizer,
                                scripted_actor(tokenizer, [lambda prompt, turns: script[len(turns)]]),
                                limits(max_turns=4))
    assert trajectory.action_errors == 2 and len(trajectory.actions) == 4 and trajectory.success


def test_learner_autocast_runs_the_body_in_bf16_and_the_head_in_float32(tiny):
    from keelrl.policy.model import _head_logprobs, learner_autocast

    model, tokenizer = tiny
    cpu = torch.device("cpu")
    assert isinstance(learner_autocast(cpu, "float32"), type(learner_autocast(cpu, "float32")))
    with pytest.raises(ValueError, match="valid: auto, float32, bfloat16"):
        learner_autocast(cpu, "fp8")
    ids = torch.tensor([tokenizer("<|user|>fix the retry bug<|end|><|assistant|><call>read</call>")["input_ids"]])
    mask = torch.ones_like(ids)
    plain = token_logprobs(model, ids, mask)["logp"]
    seen = []
    hook = model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with learner_autocast(cpu, "bfloat16"):
        mixed = token_logprobs(model, ids, mask)["logp"]
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        head_logp, _ = _head_logprobs(model.get_output_embeddings(), hidden[:, :-1], ids[:, 1:], False)
    hook.remove()
    assert seen and set(seen) == {torch.bfloat16}  # the body's matrix products really ran in bf16
    assert mixed.dtype == torch.float32 and not torch.equal(mixed, plain)
    torch.testing.assert_close(mixed, plain, rtol=0, atol=0.05)  # bf16 body noise, nothing worse
    # the head saw float32 inputs and weights: equal to a float32 head on the same hidden states
    reference = torch.log_softmax(hidden[:, :-1].float() @ model.get_output_embeddings().weight.T, -1)
    torch.testing.assert_close(head_logp, reference.gather(-1, ids[:, 1:, None])[..., 0], rtol=1e-5, atol=1e-5)


def test_a_sampler_longer_than_the_rollouts_reserve_is_refused(tiny):
    """An action longer than the room the scheduler keeps could overflow max_context_tokens."""
    model, tokenizer = tiny
    teacher_task = retry_task()
    with pytest.raises(ValueError, match="max_new_tokens=40 is more than the 16 tokens"):
        run_episodes(lambda: CodingEnv(), [teacher_task], tokenizer,
                     model_actor(model, tokenizer, SamplingParams(max_new_tokens=40)),
                     limits(max_turns=1, max_new_tokens=16))
