"""An agent harness that knows nothing of keelrl: its own loop over an OpenAI-compatible API.

It imports `openai` and the standard library only. Pointed at a keelrl training run's endpoint
(`keel train rollout.engine=endpoint rollout.harness="python examples/openai_harness/harness.py"`
starts it with OPENAI_BASE_URL, OPENAI_API_KEY, KEEL_ENDPOINT and KEEL_MODEL set), it takes
episodes from the run, plays each with chat completions and tool calls, and has the run's
environment execute every reply, until the run needs no more episodes:

    POST {KEEL_ENDPOINT}/keel/v1/episodes              -> session id, first messages, tools
    client.chat.completions.create(..., extra_headers={"X-Session-Id": session})
    POST {KEEL_ENDPOINT}/keel/v1/episodes/{id}/step    -> observation, done

--compact N keeps only the first message and the last N exchanges of the history, as harnesses
with context compaction do: the endpoint then records each compacted stretch as its own sample.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request

from openai import BadRequestError, OpenAI


def keel(path: str, body: dict | None = None) -> tuple[int, dict]:
    """POST to the training run's own routes; (status, JSON body)."""
    request = urllib.request.Request(f"{os.environ['KEEL_ENDPOINT']}/keel/v1/{path}", method="POST",
                                     data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', '')}"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def compacted(messages: list[dict], keep: int) -> list[dict]:
    """The first message and the last `keep` exchanges (an assistant message and what answered it)."""
    if keep <= 0 or len(messages) <= 1 + 2 * keep:
        return messages
    return messages[:1] + messages[-2 * keep:]


def play(client: OpenAI, model: str, episode: dict, keep: int) -> int:
    """One episode; returns the number of chat calls made."""
    session, messages, tools = episode["session_id"], list(episode["messages"]), episode["tools"]
    calls = 0
    while True:
        history = compacted(messages, keep)
        try:
            reply = client.chat.completions.create(model=model, messages=history, tools=tools or None,
                                                   extra_headers={"X-Session-Id": session})
        except BadRequestError as error:  # the context is full: the run has ended the episode
            if "context_length_exceeded" in str(error):
                return calls
            raise
        calls += 1
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        status, stepped = keel(f"episodes/{session}/step")
        if status != 200:
            raise RuntimeError(f"step of {session} answered {status}: {stepped}")
        if stepped["done"]:
            return calls
        if message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id,
                             "content": stepped["observation"]})
        else:
            messages.append({"role": "user", "content": stepped["observation"]})


def worker(client: OpenAI, model: str, keep: int, counts: list[int], errors: list[BaseException]) -> None:
    try:
        while True:
            status, episode = keel("episodes", {"wait_s": 30})
            if status == 410:  # the run needs no more episodes
                return
            if status == 503:  # none ready yet (the learner is updating)
                time.sleep(0.05)
                continue
            if status != 200:
                raise RuntimeError(f"taking an episode answered {status}: {episode}")
            if not episode.get("done"):
                counts.append(play(client, model, episode, keep))
    except BaseException as error:  # noqa: BLE001 - reported by main
        errors.append(error)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8, help="episodes played at once")
    parser.add_argument("--compact", type=int, default=0, help="keep only the last N exchanges (0: everything)")
    args = parser.parse_args()
    client = OpenAI(max_retries=0, timeout=600)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    model = os.environ.get("KEEL_MODEL", "keel-policy")
    counts: list[int] = []
    errors: list[BaseException] = []
    threads = [threading.Thread(target=worker, args=(client, model, args.compact, counts, errors))
               for _ in range(args.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(f"harness: {len(counts)} episodes, {sum(counts)} chat calls", flush=True)
    if errors:
        print(f"harness: {errors[0]!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
