"""The staleness policies of the systems users would otherwise pick, as each runs by default.

Each rule is taken from the peer's own code and cited next to it (repository, file, function;
read at inclusionAI/AReaL 4aef98d, volcengine/verl b178a3c, thinking-machines-lab/tinker-cookbook
9dfcc3a). A peer's own knobs are ``sim.areal.*``, ``sim.tinker.*`` and ``sim.verl.*``, with the
peer's defaults; the integer staleness bound of AReaL (``max_head_offpolicyness``) and Tinker
(``max_steps_off_policy``) is ``psrl.staleness``. A "sample" or "rollout" of a peer is one prompt's
group of N trajectories here, as it is there. Every policy trains B groups per step; a group the
filter drops is discarded and its place taken by a new one.

* ``sync`` -- batch k is generated with weights k, then trained (staleness 0).
* ``one_step_off`` -- verl's one-step-off recipe: wait for batch j, sync weights (the trainer
  waits), launch batch j+1, train batch j.
* ``areal`` -- AReaL's StalenessManager and WorkflowExecutor: capacity = min(concurrency,
  staleness capacity); completed groups handed out oldest-submitted first; a weight update pauses
  submission and generation and blocks the trainer.
* ``discard_requeue`` -- the Tinker cookbook's async loop: ``groups_per_batch`` worker coroutines,
  no admission cap; the training loop drops (and requeues) groups more than
  ``max_steps_off_policy`` steps stale; the trainer waits for its weights to be saved for sampling.
* ``sample_budget`` -- verl fully-async: ``int(B * (staleness_threshold + 1) * k)`` samples per
  sync period (k = ``trigger_parameter_sync_step``; the count restarts at the samples in flight or
  queued when weights sync), at most ``max_concurrent_samples`` in flight, weights synced every k
  steps, a sync pauses the rollouter (partial rollout: in-flight generations stop and resume) and
  blocks the trainer.
"""

from __future__ import annotations

import heapq
from collections import deque

from psrl.sim.engine import Engine, Group
from psrl.sim.workload import Workload

__all__ = [
    "BatchedPolicy",
    "Sync",
    "OneStepOff",
    "Areal",
    "DiscardRequeue",
    "SampleBudget",
    "verl_max_required_samples",
]


class _QueuePolicy(Engine):
    """Shared part of the continuous policies: completed groups the trainer takes B at a time
    (``take`` decides which; completion order by default)."""

    def __init__(self, wl: Workload):
        super().__init__(wl)
        self.running = 0
        self.ready: deque[Group] = deque()

    def next_group(self) -> Group | None:
        if not self.admit():
            return None
        self.running += 1
        return self.new_group(self.wl.group_size)

    def admit(self) -> bool:
        """Whether one more group may be submitted now."""
        raise NotImplementedError

    def on_member_done(self, idx: int, g: Group) -> None:
        g.completed.append(idx)
        if len(g.completed) < g.size:
            return
        self.running -= 1
        if self.keep_group(g):
            self.accept(g)
            self.put_ready(g)
            self.on_trainer_free()
        else:
            self.end_group(g)

    def accept(self, g: Group) -> None:
        """A completed group passed the filter (AReaL counts it)."""

    def put_ready(self, g: Group) -> None:
        self.ready.append(g)

    def take(self) -> Group:
        return self.ready.popleft()

    def n_ready(self) -> int:
        return len(self.ready)

    def on_trainer_free(self) -> None:
        if self.trainer_busy or self.n_ready() < self.wl.batch_size:
            return
        batch = []
        for _ in range(self.wl.batch_size):
            batch.extend(self.take().completed)
        self.start_training(batch, self.trainer_version)


class Areal(_QueuePolicy):
    """AReaL: capacity = min(max_concurrent_rollouts - running, (eta + v + 1) * B - (accepted + running))."""

    name = "areal"
    # areal/trainer/rl_trainer.py PPOTrainer.train: after the step, ``self.rollout.pause()`` (no new
    # submission), then ``self.actor.update_weights(...)`` inside the training loop (the trainer
    # waits), which in areal/engine/fsdp_engine.py _update_weights_from_distributed calls
    # ``rollout_engine.pause_generation()`` ... ``continue_generation()``; ``set_version`` after it.
    sync_blocks_trainer = True
    sync_pauses_generation = True

    def __init__(self, wl: Workload):
        super().__init__(wl)
        self.accepted = 0
        # areal/infra/workflow_executor.py WorkflowExecutor.__init__:
        # ``config.max_concurrent_rollouts or config.consumer_batch_size``
        # (areal/api/cli_args.py InferenceEngineConfig.max_concurrent_rollouts: default None).
        self.max_concurrent = wl.areal_max_concurrent_rollouts or wl.batch_size
        self.ready_heap: list[tuple[int, Group]] = []

    def admit(self) -> bool:
        # areal/infra/staleness_manager.py StalenessManager.get_capacity:
        #   concurrency_capacity = max(1, max_concurrent_rollouts) - running
        #   staleness_capacity = (max_staleness + current_version + 1) * max(1, consumer_bs) - (accepted + running)
        #   capacity = min(concurrency_capacity, staleness_capacity); submit while capacity > 0
        # (workflow_executor.py BatchTaskDispatcher._get_next_task_for_submission).
        B = max(1, self.wl.batch_size)
        conc = max(1, self.max_concurrent) - self.running
        stale = (self.eta + self.gen_version + 1) * B - (self.accepted + self.running)
        return min(conc, stale) > 0

    def accept(self, g: Group) -> None:
        # StalenessManager.on_rollout_accepted: running -= 1, accepted += 1 (a rejected one is not counted)
        self.accepted += 1

    def put_ready(self, g: Group) -> None:
        heapq.heappush(self.ready_heap, (g.ordinal, g))

    def take(self) -> Group:
        # workflow_executor.py BatchTaskDispatcher.wait_results: every completed result is drained,
        # ``drained.sort(key=lambda x: x.create_time)`` and the first ``count`` are returned: the
        # oldest *submitted* completed groups (create_time is set when the task is submitted,
        # areal/infra/async_task_runner.py), not the first completed. Groups are created in
        # submission order, so ``ordinal`` orders them as create_time does.
        return heapq.heappop(self.ready_heap)[1]

    def n_ready(self) -> int:
        return len(self.ready_heap)


def verl_max_required_samples(batch_size: int, staleness_threshold: float, trigger_parameter_sync_step: int) -> int:
    """verl/experimental/fully_async_policy/fully_async_rollouter.py FullyAsyncRollouter.set_max_required_samples:
    ``int(required_samples * (staleness_threshold + 1) * trigger_parameter_sync_step)`` (truncated, as there)."""
    return int(batch_size * (staleness_threshold + 1) * trigger_parameter_sync_step)


class SampleBudget(_QueuePolicy):
    """verl fully-async: a sample budget per weight-sync period, a concurrency cap, partial rollout."""

    name = "sample_budget"
    # fully_async_policy/param_sync.py ParameterSynchronizer.sync_weights: ``rollouter.pause()``
    # (partial_rollout, the default: in-flight generations are cancelled and put on the cancel queue,
    # to resume from their partial output), the weights are synced, then update_param_version and
    # resume; the trainer waits for it (fully_async_trainer.py _trigger_parameter_sync_after_step:
    # ``ray.get(self.param_synchronizer.sync_weights.remote(...))``).
    sync_blocks_trainer = True
    sync_pauses_generation = True

    def __init__(self, wl: Workload):
        super().__init__(wl)
        # fully_async_trainer.py _trigger_parameter_sync_after_step: a sync every
        # trigger_parameter_sync_step local steps (config default 4, fully_async_ppo_trainer.yaml).
        self.k = wl.verl_trigger_parameter_sync_step
        self.budget = verl_max_required_samples(wl.batch_size, wl.verl_staleness_threshold, self.k)
        # set_max_required_samples: ``len(server_handles) * 16``, then ``min(.., max_required_samples)``
        self.max_concurrent = min(wl.verl_max_concurrent_samples, self.budget)
        self.submitted = 0  # the rollouter's staleness_samples

    def admit(self) -> bool:
        # fully_async_rollouter.py _processor_worker: pause while
        # ``staleness_samples >= max_required_samples`` (_should_pause_generation) until the next sync
        # resumes it; wait while ``len(active_tasks) >= max_concurrent_samples``; each sample taken from
        # the pending queue counts ``staleness_samples += 1``. (The queue-full pause never binds first:
        # max_queue_size = max_required_samples and the queue only holds counted samples.)
        if self.submitted >= self.budget or self.running >= self.max_concurrent:
            return False
        self.submitted += 1
        return True

    def end_group(self, g: Group) -> None:
        # verl's fully-async rollouter has no group filter (nothing in fully_async_policy/ drops a
        # sample); a group our filter drops is regenerated outside the budget, or the run would stall.
        if not g.ended:
            self.submitted -= 1
        super().end_group(g)

    def publishes(self, version: int) -> bool:
        return version % self.k == 0

    def on_publish(self) -> None:
        # fully_async_rollouter.py update_param_version: ``staleness_samples = len(active_tasks) +
        # cancel_queue.qsize() + message_queue size``: the samples in flight or not yet trained.
        self.submitted = self.running + len(self.ready)


class DiscardRequeue(_QueuePolicy):
    """Tinker cookbook: a fixed number of worker coroutines; too-stale groups dropped and requeued."""

    name = "discard_requeue"
    # tinker_cookbook/rl/train.py do_async_training.training_loop: after ``train_step`` the loop awaits
    # the new sampling client (do_train_step_and_get_sampling_client -> save_weights_and_get_sampling_client
    # / save_checkpoint_async) before pulling more groups; the workers keep sampling with the old client.
    sync_blocks_trainer = True
    sync_pauses_generation = False

    def __init__(self, wl: Workload):
        super().__init__(wl)
        # train.py do_async_training: ``groups_per_batch`` trajectory_group_worker_loop coroutines, each
        # taking one env group builder at a time; no staleness cap on what they start.
        self.workers = wl.tinker_groups_per_batch or wl.batch_size

    def admit(self) -> bool:
        return self.running < self.workers

    def on_trainer_free(self) -> None:
        if self.trainer_busy:
            return
        # train.py training_loop.filter_stale_trajectory_group: groups are pulled in completion order;
        # ``i_batch - sampling_client_step > max_steps_off_policy`` -> the builder is requeued (here: a
        # new group, with the stream's next draws, when a worker is free) and the group dropped.
        # sampling_client_step is the version the worker sampled with (V_traj), i_batch the step it would
        # be trained in (the trainer's version now).
        c, ver, B = self.trainer_version, self.t_ver, self.wl.batch_size
        ready = self.ready
        fresh: deque[Group] = deque()
        while ready and len(fresh) < B:
            g = ready.popleft()
            if c - min(ver[i] for i in g.completed) > self.eta:
                self.end_group(g)
            else:
                fresh.append(g)
        fresh.extend(ready)
        self.ready = fresh
        super().on_trainer_free()


class BatchedPolicy(Engine):
    """Generate one batch at a time; batch j may start once batch j-1 is generated and the
    generators hold version >= j - lag. lag 0 is synchronous RL."""

    lag = 0

    def __init__(self, wl: Workload):
        super().__init__(wl)
        self.batch = 0  # batch being generated
        self.kept: list[Group] = []
        self.in_progress = 0  # groups of this batch launched and not finished
        self.started = False
        self.done: deque[list[int]] = deque()

    def may_start(self) -> bool:
        """Whether the generation of batch ``self.batch`` may begin now."""
        return self.gen_version >= self.batch - self.lag

    def next_group(self) -> Group | None:
        B = self.wl.batch_size
        if not self.started:
            if not self.may_start():
                return None
            self.started = True
        if len(self.kept) + self.in_progress >= B:
            return None
        self.in_progress += 1
        return self.new_group(self.wl.group_size, batch=self.batch)

    def on_member_done(self, idx: int, g: Group) -> None:
        g.completed.append(idx)
        if len(g.completed) < g.size:
            return
        self.in_progress -= 1
        if not self.keep_group(g):
            self.end_group(g)
            return
        self.kept.append(g)
        if len(self.kept) == self.wl.batch_size:
            self.done.append([i for k in self.kept for i in k.completed])
            self.kept, self.started = [], False
            self.batch += 1
            self.on_trainer_free()

    def on_trainer_free(self) -> None:
        if not self.trainer_busy and self.done:
            self.start_training(self.done.popleft(), self.trainer_version)


class Sync(BatchedPolicy):
    name = "sync"
    lag = 0


class OneStepOff(BatchedPolicy):
    """verl one-step-off: the weight sync sits between two batches and the trainer waits for it.

    verl/experimental/one_step_off_policy/ray_trainer.py OneStepOffRayTrainer.fit, per step j:
    ``await batch_data_future`` (batch j), ``self.sync_rollout_weights()`` (blocking), launch
    ``_async_gen_next_batch`` (batch j+1, with the weights just synced), then train batch j. So batch
    j+1 carries V = j and is trained at version j + 1 (staleness 1; batch 0 staleness 0), and the
    period is sync_time + max(train, generation).
    """

    name = "one_step_off"
    lag = 1

    def __init__(self, wl: Workload):
        super().__init__(wl)
        self.released = 0  # batches allowed to start: batch 0 at once (after the initial sync at t=0)

    def publishes(self, version: int) -> bool:
        return False  # the policy syncs itself, between batches

    def may_start(self) -> bool:
        return self.batch <= self.released

    def on_trainer_free(self) -> None:
        if self.trainer_busy or not self.done:
            return
        batch = self.done.popleft()
        if self.wl.sync_time > 0:
            self.trainer_busy = True
            self.at(self.now + self.wl.sync_time, lambda: self._synced(batch))
        else:
            self._synced(batch)

    def _synced(self, batch: list[int]) -> None:
        self.trainer_busy = False
        self.gen_version = self.trainer_version
        self.released = self.trainer_version + 1
        self.start_training(batch, self.trainer_version)
