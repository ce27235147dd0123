"""The tiny CPU recipe's trainer in this process (real Ray workers, megatron-core on gloo ranks):
the update is the same over one or two workers, a checkpoint resumes under another layout, a dead
worker and a failing reward function are named, DP rows keep each mini-batch whole."""

from __future__ import annotations

import pytest
import torch

from tests.recipe_runs import assert_same_step, split_tolerances, start_trainer

@pytest.mark.slow
def test_update_is_the_same_with_one_or_two_workers(tmp_path, local_ray):
    results = {}
    for workers in (1, 2):
        trainer = start_trainer(tmp_path, f"dp{workers}", [
            f"trainer.n_gpus_per_node={workers}", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=1",
            f"actor_rollout_ref.rollout.data_parallel_size={workers}",
        ])
        try:
            assert trainer.dp_size == workers
            results[workers] = [trainer.train_step(step) for step in (1, 2)]
        finally:
            trainer.close()
    for one, two in zip(results[1], results[2]):
        assert_same_step(one, two, trainer.cfg)


@pytest.mark.slow
def test_resume_under_another_layout_continues_the_run(tmp_path, local_ray):
    """A checkpoint written under EP2 (tiny_cpu.yaml) after step 1, in the background while step 2
    trains (async save: not resumable until complete), resumed under TP2 with sequence parallel:
    step 2 samples the same rollouts (the data position and the weights came back exactly) and
    updates within fp32 rounding of the EP2 run's step 2 (weights, Adam moments, LR schedule)."""
    from recipe.run_dir import checkpoints

    writer = start_trainer(tmp_path, "ep2", ["actor_rollout_ref.actor.checkpoint.async_save=true"])
    try:
        writer.train_step(1)
        writer.step = 1
        blocking = writer.save_checkpoint(wait=False)
        assert blocking["timing_s/save_checkpoint"] > 0 and "perf/checkpoint_bytes" not in blocking
        assert checkpoints(writer.ckpt_dir) == []  # still being written
        expected = writer.train_step(2)
        saved = writer._finish_save()
    finally:
        writer.close()
    assert checkpoints(writer.ckpt_dir) == [saved]
    assert sorted(p.name for p in saved.iterdir()) == ["actor", "trainer_state.json"]
    assert (saved / "actor" / "metadata.json").is_file() and (saved / "actor" / "huggingface" / "config.json").is_file()
    reader = start_trainer(tmp_path, "tp2", [
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=1",
        "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=2",
        "actor_rollout_ref.actor.megatron.sequence_parallel=true",
        "trainer.resume_mode=resume_path", f"trainer.resume_from_path={saved}",
    ])
    try:
        assert reader.step == 1 and reader.kl_ctrl.value == writer.kl_ctrl.value
        got = reader.train_step(2)
    finally:
        reader.close()
    for key in ("critic/score/mean", "response_length/mean", "critic/advantages/max", "actor/lr"):
        assert got[key] == expected[key], key
    tolerance = split_tolerances(expected, reader.cfg)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl"):
        assert got[key] == pytest.approx(expected[key], rel=0, abs=tolerance[key]), key


@pytest.mark.slow
def test_a_dead_worker_is_named(tmp_path, local_ray):
    import ray

    from recipe.workers.group import WorkerDiedError

    trainer = start_trainer(tmp_path, "dead", [])
    try:
        trainer.step = 1
        ray.kill(trainer.workers.workers[1])
        with pytest.raises(WorkerDiedError, match="worker rank 1") as info:
            trainer.fit()
        assert any("last completed step: 1" in n for n in info.value.__notes__)
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_worker_killed_after_a_checkpoint_is_named_and_leaves_no_process(tmp_path, local_ray):
    """After a save (whose writers report through a helper process), kill -9 of a worker: the next
    call names it within the time Ray takes to see a process go (the helper must not hold the
    worker's sockets, which kept the driver waiting for minutes), and nothing the worker started is
    left running."""
    import os
    import signal
    import time

    import psutil
    import ray

    from recipe.workers.group import WorkerDiedError
    from recipe.workers.rank import Rank

    trainer = start_trainer(tmp_path, "dead_after_save", [])
    try:
        world = trainer.workers.world_size
        trainer.workers.call(Rank.save, [(str(tmp_path / "ckpt" / "actor"),)] * world, "checkpoint save")
        trainer.workers.call(Rank.finish_save)
        victim = trainer.workers.workers[1]
        pid = ray.get(victim.__ray_call__.remote(lambda self: os.getpid()))
        helpers = psutil.Process(pid).children(recursive=True)
        assert helpers, "the save started no helper process: nothing to check"
        os.kill(pid, signal.SIGKILL)
        trainer.step = 1
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="worker rank 1"):
            trainer.fit()
        assert time.monotonic() - start < 120  # Ray's own report of a lost worker: seconds, not minutes
        gone, alive = psutil.wait_procs(helpers, timeout=10)
        assert not alive, f"processes the killed worker started are still running: {alive}"
    finally:
        trainer.close()


@pytest.mark.slow
def test_reward_function_error_names_the_sample(tmp_path, local_ray):
    from recipe.reward import RewardError

    fn = tmp_path / "reward.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                  "    raise KeyError('oops')\n")
    trainer = start_trainer(tmp_path, "reward", [f"custom_reward_function.path={fn}"])
    try:
        with pytest.raises(RewardError, match="row 0") as info:
            trainer.fit()
        assert isinstance(info.value.__cause__, KeyError)
        assert any("last completed step: 0" in n for n in info.value.__notes__)
    finally:
        trainer.close()


def _dp_rows(dp_size: int, dynamic: bool, ends: list[int], mini: int) -> list[list[int]]:
    from recipe.driver.trainer import Trainer

    t = Trainer.__new__(Trainer)
    t.dp_size, t.dynamic_batches = dp_size, dynamic
    batch = {"input_ids": torch.zeros(len(ends), 1), "prompt_lengths": torch.tensor(ends) - 1,
             "response_mask": torch.ones(len(ends), 1)}
    return [s.tolist() for s in t.dp_rows(batch, mini)]


def test_dp_rows_keep_each_mini_batch_whole():
    ends = [5, 9, 2, 7, 3, 8, 4, 6]
    assert _dp_rows(2, False, ends, 4) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert _dp_rows(1, False, ends, 4) == [list(range(8))]
    # dynamic batch size: longest first, dealt in snake order within each mini-batch
    # mini-batch 0 (rows 0-3) by length: 1 (9), 3 (7), 0 (5), 2 (2); mini-batch 1: 5 (8), 7 (6), 6 (4), 4 (3)
    assert _dp_rows(2, True, ends, 4) == [[1, 2, 5, 4], [3, 0, 7, 6]]
    assert _dp_rows(1, True, ends, 4) == [[1, 3, 0, 2, 5, 7, 6, 4]]
    for dynamic in (False, True):  # every row once, each mini-batch whole
        first, second = _dp_rows(2, dynamic, ends, 4)
        assert sorted(first[:2] + second[:2]) == [0, 1, 2, 3] and sorted(first + second) == list(range(8))
