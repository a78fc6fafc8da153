"""The `ray` rollout engine: rollout workers as Ray actors, on any number of CPUs or machines.

Each worker actor loads the policy from `model_path` (a path every node can read), runs an
`EpisodeScheduler` in a background thread, and takes weights from the learner through the
object store: `publish` puts one copy of the (merged) state dict there and hands every worker
the reference, which the worker's decoder loads between turns (`load_weights`,
keelrl.inference.weights). A worker admits a request only once it holds weights at least as new
as the request's `min_version`, exactly like the local engines, so the staleness bound holds
across machines.

Requests are spread over workers (fewest outstanding first). The driver remembers every
request a worker has not yet returned; when a worker dies (a node lost, an OOM kill,
`ray.kill`), a fresh actor replaces it, receives the latest weights and the dead worker's
outstanding requests are re-queued on it: nothing is lost, and each re-run request samples
from the same seeds.

Slow is not dead. The driver keeps one poll in flight per worker and never times a single
call out: a worker starved of CPU (a loaded machine, a model that takes minutes to load) is
waited for. Ray reports a dead actor at once; only a worker that has answered nothing for
`worker_timeout_s` is presumed hung and replaced like a dead one.

`ray.init()` connects to an existing cluster when RAY_ADDRESS is set, else starts a local one
(`init_local_ray`) whose workers run at the driver's priority (Ray nices its workers by
default, so on a busy machine they would crawl while the learner waits on them); an engine
that started Ray shuts it down on close.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from keelrl.inference import DecoderOptions, SamplingParams
from keelrl.rollout.engines import RequestsFor, RolloutEngine, StepRollouts, staleness_metrics
from keelrl.rollout.scheduler import (EpisodeScheduler, GroupRequest, GroupResult, EpisodeLimits, SchedulerStats,
                                      WeightSlot)


def init_local_ray(**kwargs: Any) -> None:
    """`ray.init` for a cluster keelrl starts itself: workers at the driver's priority
    (worker_niceness 0), no dashboard unless asked, workers' logs not forwarded. With RAY_ADDRESS
    set this joins that cluster instead (its own settings apply)."""
    import ray

    kwargs.setdefault("log_to_driver", False)
    kwargs.setdefault("include_dashboard", False)
    system_config = dict(kwargs.pop("_system_config", None) or {})
    system_config.setdefault("worker_niceness", 0)
    ray.init(_system_config=system_config, **kwargs)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to build its policy copy and environments (picklable)."""

    model_path: str
    make_env: Callable[[], Any]
    sampling: SamplingParams
    rollout: EpisodeLimits
    device: str = "cpu"
    torch_threads: int = 1
    cpu_cores: tuple[int, ...] = ()
    """Pin the worker's process to these cores (empty: no pinning)."""
    decoder_options: DecoderOptions = DecoderOptions()


class RolloutWorker:
    """One rollout worker (a Ray actor's body; also usable in-process)."""

    def __init__(self, spec: WorkerSpec) -> None:
        import torch

        from keelrl.policy import lora
        from keelrl.policy.model import load_policy
        from keelrl.rollout.agent_loop import model_actor

        if spec.cpu_cores:
            from keelrl.policy.model import pin_to_cores

            pin_to_cores(spec.cpu_cores)
        torch.set_num_threads(max(1, spec.torch_threads))
        self.model, self.tokenizer = load_policy(spec.model_path, spec.device)
        if lora.is_lora(self.model):  # model.path is an adapter: the learner publishes merged weights
            self.model = lora.merged_model(self.model)
        self.model.eval().requires_grad_(False)
        self._lock = threading.Lock()
        act = model_actor(self.model, self.tokenizer, spec.sampling, spec.decoder_options)
        # no weights from the learner yet: nothing may start
        self.weights = WeightSlot.for_actor(act, self.model, version=-1)
        self.scheduler = EpisodeScheduler(spec.make_env, self.tokenizer, act, spec.rollout,
                                          refresh=self.weights.refresh, has_newer=self.weights.has_newer)
        self._finished: list[GroupResult] = []
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="keel-ray-rollout", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                finished = self.scheduler.run_once(timeout=0.01)
                if finished:
                    with self._lock:
                        self._finished.extend(finished)
        except BaseException as error:  # reported to the driver by poll()
            import traceback

            self._error = "".join(traceback.format_exception(error))

    def set_weights(self, state: dict[str, Any], version: int) -> int:
        self.weights.offer(state, version)
        return version

    def submit(self, requests: list[GroupRequest]) -> int:
        self.scheduler.submit(requests)
        return len(requests)

    def poll(self) -> tuple[list[GroupResult], SchedulerStats]:
        """Groups finished since the last poll, and the scheduler's counters since then."""
        if self._error is not None:
            raise RuntimeError(f"rollout worker loop failed:\n{self._error}")
        with self._lock:
            finished, self._finished = self._finished, []
        return finished, self.scheduler.take_stats()

    def version(self) -> int:
        return self.weights.held

    def placement(self) -> dict[str, Any]:
        """Where this worker runs: its process id, the CPU cores of each of its threads, torch's threads."""
        import torch

        tasks = os.listdir("/proc/self/task")
        return {"pid": os.getpid(), "torch_threads": torch.get_num_threads(),
                "thread_cores": sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in tasks
                                        if os.path.exists(f"/proc/self/task/{t}")})}

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.scheduler.close()


class RayEngine(RolloutEngine):
    """Rollout workers as Ray actors (see the module docstring)."""

    name = "ray"

    def __init__(self, requests_for: RequestsFor, *, model_path: str, tokenizer: Any, make_env: Callable[[], Any],
                 sampling: SamplingParams, rollout: EpisodeLimits, max_staleness: int = 1, workers: int = 2,
                 worker_cpus: float = 1.0, worker_cores: tuple[int, ...] = (), seed: int = 0,
                 poll_interval: float = 0.02,
                 worker_timeout_s: float = 600.0, decoder_options: DecoderOptions = DecoderOptions(),
                 ray_module: Any = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        import ray

        super().__init__(requests_for, max_staleness)
        from keelrl.policy.model import ensure_model_dir

        self._ray = ray_module if ray_module is not None else ray  # a stand-in module in unit tests
        self._clock, self._sleep = clock, sleep
        self._started_ray = False
        if not self._ray.is_initialized():
            if self._ray is ray and "RAY_ADDRESS" not in os.environ:
                init_local_ray()
            else:
                self._ray.init(log_to_driver=False)  # RAY_ADDRESS set: join that cluster
            self._started_ray = True
        self.spec = WorkerSpec(model_path=str(ensure_model_dir(model_path)), make_env=make_env, sampling=sampling,
                               rollout=rollout, torch_threads=max(1, int(worker_cpus)),
                               decoder_options=decoder_options)
        self.worker_cores = tuple(worker_cores)
        self._actor_class = self._ray.remote(num_cpus=worker_cpus, max_restarts=0)(RolloutWorker)
        self.actors = [self._spawn(slot) for slot in range(workers)]
        self.outstanding: list[dict[int, GroupRequest]] = [{} for _ in self.actors]
        self._weights: tuple[Any, int] | None = None
        self._results: dict[int, GroupResult] = {}
        self.poll_interval = poll_interval
        if not worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be > 0, got {worker_timeout_s!r}")
        self.worker_timeout_s = worker_timeout_s
        self._polls: dict[int, tuple[Any, float]] = {}  # slot -> (poll in flight, when it was sent)
        self.workers_replaced = 0
        self.workers_hung = 0
        self.requests_requeued = 0

    def _spawn(self, slot: int) -> Any:
        """A new actor for worker `slot` (pinned to its core when worker_cores is set)."""
        spec = self.spec
        if self.worker_cores:
            core = self.worker_cores[slot % len(self.worker_cores)]
            spec = dataclasses.replace(spec, cpu_cores=(core,), torch_threads=1)
        return self._actor_class.remote(spec)

    def _replace(self, slot: int) -> None:
        """Start a new actor in `slot`, give it the latest weights and the dead one's unfinished requests."""
        try:
            self._ray.kill(self.actors[slot])
        except Exception:  # already gone: the usual reason to replace it
            pass
        self._polls.pop(slot, None)
        self.actors[slot] = self._spawn(slot)
        self.workers_replaced += 1
        if self._weights is not None:
            self.actors[slot].set_weights.remote(*self._weights)
        lost = sorted(self.outstanding[slot].values(), key=lambda r: r.index)
        if lost:
            self.actors[slot].submit.remote(lost)
            self.requests_requeued += len(lost)

    def publish(self, state: dict[str, Any], version: int) -> None:
        super().publish(state, version)
        ref = self._ray.put({name: tensor.detach().cpu() for name, tensor in state.items()})
        self._weights = (ref, version)
        for actor in self.actors:
            actor.set_weights.remote(ref, version)

    def _submit(self, requests: list[GroupRequest]) -> None:
        for request in requests:
            slot = min(range(len(self.actors)), key=lambda i: len(self.outstanding[i]))
            self.outstanding[slot][request.index] = request
            self.actors[slot].submit.remote([request])

    def _wait(self, wanted: list[int], totals: SchedulerStats) -> list[GroupResult]:
        from ray.exceptions import RayActorError

        while not all(index in self._results for index in wanted):
            for slot, actor in enumerate(self.actors):
                if slot not in self._polls:
                    self._polls[slot] = (actor.poll.remote(), self._clock())
            by_ref = {id(ref): slot for slot, (ref, _) in self._polls.items()}
            ready, _ = self._ray.wait([ref for ref, _ in self._polls.values()], num_returns=len(self._polls),
                                      timeout=self.poll_interval)
            for ref in ready:
                slot = by_ref[id(ref)]
                del self._polls[slot]
                try:
                    finished, stats = self._ray.get(ref)
                except RayActorError:  # dead (killed, OOM, node lost): Ray says so at once
                    self._replace(slot)
                    continue
                for result in finished:
                    self.outstanding[slot].pop(result.request.index, None)
                    self._results[result.request.index] = result
                totals.generate_s += stats.generate_s
                totals.idle_s += stats.idle_s
                totals.in_flight_max = max(totals.in_flight_max, stats.in_flight_max)
                totals.admitted += stats.admitted
                totals.prefill_tokens += stats.prefill_tokens
            now = self._clock()
            for slot, (_, sent) in list(self._polls.items()):
                if now - sent > self.worker_timeout_s:  # alive to Ray but silent this long: hung
                    self.workers_hung += 1
                    self._replace(slot)
            if ready:  # answered at once: pace the next round of polls
                self._sleep(self.poll_interval)
        return [self._results.pop(index) for index in wanted]

    def batch(self, step: int) -> StepRollouts:
        self._check_open()
        tick = time.monotonic()
        for future_step in self._steps_to_submit(step):
            self._submit(self._requests(future_step))
        totals = SchedulerStats()
        results = self._wait([r.index for r in self._requests(step)], totals)
        trajectories = [t for result in results for t in result.trajectories]
        metrics = staleness_metrics(step, trajectories, self.max_staleness)
        metrics.update({"time/rollout_generate_s": totals.generate_s, "time/rollout_idle_s": totals.idle_s,
                        "engine/in_flight_max": float(totals.in_flight_max),
                        "engine/groups_admitted": float(totals.admitted),
                        "engine/prefill_tokens": float(totals.prefill_tokens),
                        "engine/workers": float(len(self.actors)),
                        "engine/workers_replaced": float(self.workers_replaced),
                        "engine/workers_hung": float(self.workers_hung),
                        "engine/requests_requeued": float(self.requests_requeued),
                        "time/learner_wait_s": time.monotonic() - tick})
        return StepRollouts(trajectories, metrics)

    def more(self, step: int, requests: list[GroupRequest]) -> list[GroupResult]:
        self._check_open()
        min_version = max(0, step - 1 - self.max_staleness)
        requests = [dataclasses.replace(r, min_version=min_version) for r in requests]
        self._submit(requests)
        return self._wait([r.index for r in requests], SchedulerStats())

    def _shutdown(self) -> None:
        """Ask each worker to stop (30 s each), kill it, and shut Ray down if this engine started it."""
        self._polls.clear()
        try:
            for actor in self.actors:
                try:
                    self._ray.get(actor.shutdown.remote(), timeout=30)
                except Exception:
                    pass
                self._ray.kill(actor)
        finally:
            self.actors = []
            if self._started_ray:
                self._ray.shutdown()

    def _release(self) -> None:
        self._results.clear()
        self._weights = None
