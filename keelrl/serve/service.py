"""The decode loop behind the endpoint: one thread owns the decoder; calls from any thread queue on it.

Every chat call becomes a `Job` (its context tokens, its sampling settings, its uniforms, its
session's kept keys and values). The loop thread submits jobs to keelrl's streaming decoder
(`KeelDecoder.submit` / `step`) as they arrive, so concurrent sessions decode together
(continuous batching) and a session's next turn runs only its new tokens where its kept keys
and values cover the context's start. A decoder that cannot stream (`hf`) runs each waiting
batch with `generate`.

Which thread samples. torch's parallel kernels ran about 1.5x slower on a second thread than on
the main thread on the 2-core CPUs measured (bench/bench_endpoint.py --decode-thread), so the
loop can be driven from outside: `run(until)` samples in the calling thread (`keel serve` on its
main thread; the endpoint engine while the learner waits for a step's episodes), and the loop's
own thread, when it has one, samples only while no caller drives.

One stream samples with one `SamplingParams`: jobs with other settings wait until the stream
drains, then the oldest waiting job's settings start the next stream. New weights (`offer`, a
merged state dict) reach the decoder through its `load_weights(state, version)`
(keelrl.inference.weights), only when nothing is decoding: while they wait, no job is admitted,
so the batch drains within one action and no completion mixes two versions. Each completion carries the version
of the weights that sampled it.

A job's `done` callback runs on the loop thread as soon as its completion is sampled, before
any HTTP reply is written: what was sampled is recorded even when the caller has gone away.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from keelrl.inference import DecoderOptions, Sample, SamplingParams, build_decoder


@dataclass(eq=False)
class Job:
    """One completion to sample."""

    context: list[int]
    params: SamplingParams
    uniforms: Tensor | None
    """[max_new_tokens] uniforms from the session's own generator (None for a decoder that takes seeds)."""
    done: Callable[[Sample, int], None]
    """Called on the loop thread with the sample and the weights' version that made it."""
    failed: Callable[[BaseException], None]
    cache: Any = None
    seed: int | None = None
    """The row's seed from the session's generator, for a decoder that takes seeds, not uniforms."""
    queued: float = field(default_factory=time.monotonic)


class DecodeLoop:
    """The loop thread and its queue (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, options: DecoderOptions = DecoderOptions(), version: int = 0,
                 thread: bool = True) -> None:
        """`thread`: run the loop in a thread of its own; False: the owner runs it (`run`), e.g. on the
        main thread, where torch's parallel kernels ran faster than on a second thread on 2-core CPUs
        (docs/bring-your-harness.md#what-it-costs)."""
        self.model = model
        self.decoder = build_decoder(model, tokenizer, options)
        self.streaming = hasattr(self.decoder, "submit")
        self._stream: Any = self.decoder
        """The decoder as a stream (submit, step, in_flight), where `streaming`."""
        self.version = version
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._tickets: dict[int, Job] = {}
        self._weights: tuple[dict[str, Any], int] | None = None
        self._stop = False
        self.error: BaseException | None = None
        self.stats = {"jobs": 0, "steps": 0, "busy_s": 0.0, "weight_loads": 0, "completion_tokens": 0}
        self._driver = threading.Lock()
        """Held by the thread running the loop: the loop's own thread, or a caller of `run`."""
        self._handover = threading.Event()
        """A caller of `run` wants to drive: the loop's own thread yields after its current step."""
        self._thread: threading.Thread | None = None
        if thread:
            self._thread = threading.Thread(target=self._background, name="keel-endpoint-decode", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ from any thread
    def submit(self, job: Job) -> None:
        with self._cv:
            if self.error is not None:
                raise RuntimeError("the endpoint's decode loop failed") from self.error
            if self._stop:
                raise RuntimeError("the endpoint's decode loop is closed")
            self._waiting.append(job)
            self._cv.notify_all()

    def offer(self, state: dict[str, Any], version: int) -> None:
        """New weights, loaded once nothing is decoding; later offers replace earlier ones."""
        with self._cv:
            self._weights = (state, version)
            self._cv.notify_all()

    def wait_version(self, version: int, timeout: float) -> bool:
        """Block until weights of at least `version` are loaded (True) or `timeout` passes."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self.version < version and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(timeout=left)
        return self.version >= version

    @property
    def pending_weights(self) -> bool:
        return self._weights is not None

    def run(self, until: Callable[[], bool]) -> None:
        """Run the loop in the calling thread until `until()` is true (checked after every decode step,
        and at least every 50 ms) or the loop is closed; the loop's own thread, if it has one, waits
        meanwhile (after its current step). Raises what the loop raised."""
        self._handover.set()
        try:
            with self._driver:
                self._run(until)
        finally:
            self._handover.clear()
            with self._cv:
                self._cv.notify_all()
        if self.error is not None:
            raise RuntimeError("the endpoint's decode loop failed") from self.error

    def _background(self) -> None:
        while not self._stop and self.error is None:
            if self._handover.is_set():
                with self._cv:
                    self._cv.wait(timeout=0.05)
                continue
            with self._driver:
                self._run(until=self._handover.is_set)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the loop thread
    def _in_flight(self) -> int:
        return self._stream.in_flight if self.streaming else 0

    def _run(self, until: Callable[[], bool] = lambda: False) -> None:
        batch: list[Job] = []
        try:
            while True:
                batch = []
                with self._cv:
                    while not self._stop and not self._waiting and not self._tickets and self._weights is None:
                        if until():
                            return
                        self._cv.wait(timeout=0.05)
                    if self._stop or until():
                        break
                    if self._weights is not None and not self._in_flight():
                        state, version = self._weights
                        self._weights = None
                        self.decoder.load_weights(state, version)
                        self.version = version
                        self.stats["weight_loads"] += 1
                        self._cv.notify_all()
                    batch = self._admit()
                tick = time.monotonic()
                if self.streaming:
                    if batch:
                        tickets = self._stream.submit([job.context for job in batch], batch[0].params,
                                                      caches=[job.cache for job in batch], **self._randomness(batch))
                        self._tickets.update(zip(tickets, batch))
                    if self._tickets:
                        finished = self._stream.step()
                        self.stats["steps"] += 1
                        for ticket, sample in finished:
                            self._finish(self._tickets.pop(ticket), sample)
                elif batch:
                    samples = self.decoder.generate([job.context for job in batch], batch[0].params,
                                                    caches=[job.cache for job in batch], **self._randomness(batch))
                    for job, sample in zip(batch, samples):
                        self._finish(job, sample)
                self.stats["busy_s"] += time.monotonic() - tick
        except BaseException as error:  # every waiting caller hears of it, those of the failed batch too
            interrupted = isinstance(error, (KeyboardInterrupt, SystemExit))
            with self._cv:
                if not interrupted:
                    self.error = error
                jobs = [job for job in batch if job not in self._tickets.values()]
                jobs += list(self._waiting) + list(self._tickets.values())
                self._waiting.clear()
                self._tickets.clear()
                self._cv.notify_all()
            for job in jobs:
                job.failed(error)
            if interrupted:  # Ctrl-C reaches the caller as itself
                raise

    def _admit(self) -> list[Job]:
        """The waiting jobs that may join now (under the lock): none while new weights wait; else
        those sampling with the running stream's settings (any settings, the oldest's, when idle)."""
        if self._weights is not None or not self._waiting:
            return []
        busy = self._in_flight() > 0
        params = next(iter(self._tickets.values())).params if busy and self._tickets else self._waiting[0].params
        batch = [job for job in self._waiting if job.params == params]
        if not self.streaming:
            batch = batch[: getattr(self.decoder, "max_batch", 64)]
        for job in batch:
            self._waiting.remove(job)
        return batch

    @property
    def takes_uniforms(self) -> bool:
        """The decoder samples by per-token uniforms (else it takes a seed per row)."""
        return bool(getattr(self.decoder, "takes_uniforms", True))

    def _randomness(self, batch: list[Job]) -> dict[str, Any]:
        if all(job.uniforms is not None for job in batch):
            return {"uniforms": torch.stack([job.uniforms for job in batch if job.uniforms is not None])}
        return {"seeds": [job.seed for job in batch]}

    def _finish(self, job: Job, sample: Sample) -> None:
        self.stats["jobs"] += 1
        self.stats["completion_tokens"] += len(sample.token_ids)
        try:
            job.done(sample, self.version)
        except BaseException as error:  # noqa: BLE001 - the caller's recording failed: it hears of it
            job.failed(error)
