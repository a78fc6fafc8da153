"""A harness through the endpoint engine gives the episodes keelrl's own loop gives: same tokens,
same behaviour log-probs, same rewards, when the harness sends each observation back as a tool
message (what keelrl's loop lays out for this chat template) and the weights and seeds are the same.

That is token in, token out end to end: the harness's message lists, rendered through the chat
template and continued from each session's recorded tokens, reproduce the in-process episode
token for token, and the endpoint samples each turn from the episode's own generator."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
from openai import OpenAI

from keelrl.config import TINY_RUN, load_config
from keelrl.labs.common import GUESS
from keelrl.rollout.engines import LocalEngine
from keelrl.serve.engine import EndpointEngine
from keelrl.train.trainer import Trainer


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def _harness(url: str, errors: list[BaseException], run_over: threading.Event) -> None:
    """Plays episodes until the run needs no more: every observation goes back as a tool message.
    The run says so with 410 while its endpoint closes; a harness that asks again only after the
    endpoint has gone finds its port closed, which ends it too once the run is over (`run_over`;
    a refused connection before that is an error)."""
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    try:
        while True:
            try:
                status, episode = _post(f"{url}/keel/v1/episodes", {"wait_s": 5})
            except urllib.error.URLError as error:
                if run_over.is_set() and isinstance(error.reason, ConnectionRefusedError):
                    return
                raise
            if status == 410:
                return
            if status == 503:
                continue
            assert status == 200, episode
            messages, session = list(episode["messages"]), episode["session_id"]
            while not episode.get("done"):
                reply = client.chat.completions.create(model=episode["model"], messages=messages,
                                                       extra_headers={"X-Session-Id": session})
                messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
                status, stepped = _post(f"{url}/keel/v1/episodes/{session}/step", {})
                assert status == 200, stepped
                if stepped["done"]:
                    break
                messages.append({"role": "tool", "content": stepped["observation"]})
    except BaseException as error:  # noqa: BLE001 - the test reports it
        errors.append(error)


@pytest.mark.parametrize("keep_kv", [True, False])
def test_endpoint_episodes_equal_the_in_process_loop_token_for_token(tiny_model_dir, keep_kv):
    cfg = load_config(overrides=[*TINY_RUN, *GUESS, f"model.path={tiny_model_dir}", "env.tool_format=hermes",
                                 "rollout.tasks_per_step=3", "rollout.group_size=2", "rollout.max_new_tokens=12",
                                 "env.max_turns=3", "rollout.dtype=float64", f"rollout.keep_kv={str(keep_kv).lower()}",
                                 "rollout.engine=sync", "warm_start.demos=0"])
    trainer = Trainer(cfg)
    parts = dict(model=trainer.model, tokenizer=trainer.tokenizer, make_env=trainer.train_env_factory(),
                 sampling=trainer.rollout_sampling(), decoder_options=trainer.decoder_options(),
                 rollout=trainer._limits())
    with LocalEngine(trainer.requests_for, asynchronous=False, **parts) as local:
        local.start(0)
        expected = local.batch(1).trajectories
    engine = EndpointEngine(trainer.requests_for, max_staleness=0, **parts)
    engine.last_step = 1
    errors: list[BaseException] = []
    run_over = threading.Event()
    try:
        engine.start(0)
        harness = threading.Thread(target=_harness, args=(engine.url, errors, run_over))
        harness.start()
        served = engine.batch(1).trajectories
    finally:
        run_over.set()  # from here on the endpoint may close under the harness
        engine.close()
    harness.join(timeout=60)
    assert not errors, errors
    assert len(served) == len(expected) == 6
    assert sum(len(t.actions) for t in served) > 6  # multi-turn episodes, not one call each
    for mine, theirs in zip(served, expected):
        assert (mine.task_id, mine.group_id) == (theirs.task_id, theirs.group_id)
        assert mine.token_ids == theirs.token_ids
        assert mine.action_mask == theirs.action_mask
        assert mine.turn_ids == theirs.turn_ids
        assert mine.prompt_length == theirs.prompt_length
        assert mine.behaviour_logprobs == pytest.approx(theirs.behaviour_logprobs, abs=1e-9)
        assert (mine.reward, mine.success, mine.termination) == (theirs.reward, theirs.success, theirs.termination)
        assert mine.observations == theirs.observations and mine.actions == theirs.actions
        assert mine.samples == 1
