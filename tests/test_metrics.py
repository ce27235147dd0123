import pytest
import torch

from recipe.tracking import metrics
from recipe.tracking.metrics import (
    Timer,
    data_metrics,
    mean_metrics,
    memory_metrics,
    moe_load_metrics,
    throughput_metrics,
)


def test_data_metrics_match_hand_computed_values():
    m = data_metrics(
        scores=torch.tensor([1.0, 0.0, 0.5, 0.5]),
        advantages=torch.tensor([1.5, -1.5, 0.25, -0.25]),
        response_lengths=torch.tensor([8, 3, 8, 5]),
        prompt_lengths=torch.tensor([4, 4, 6, 6]),
        max_response_length=8,
        acc=torch.tensor([1.0, 0.0, 1.0, 0.0]),
    )
    assert m == pytest.approx(
        {
            "critic/score/mean": 0.5,
            "critic/score/max": 1.0,
            "critic/score/min": 0.0,
            "critic/advantages/mean": 0.0,
            "critic/advantages/max": 1.5,
            "critic/advantages/min": -1.5,
            "response_length/mean": 6.0,
            "response_length/max": 8.0,
            "response_length/min": 3.0,
            "response_length/clip_ratio": 0.5,  # two of four responses hit max_response_length
            "prompt_length/mean": 5.0,
            "prompt_length/max": 6.0,
            "prompt_length/min": 4.0,
            "critic/acc/mean": 0.5,
        }
    )
    assert all(type(value) is float for value in m.values())


def test_data_metrics_without_acc_has_no_acc_key_and_rejects_mismatched_lengths():
    args = dict(
        scores=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([1.0, -1.0]),
        response_lengths=torch.tensor([2, 4]),
        prompt_lengths=torch.tensor([3, 3]),
        max_response_length=16,
    )
    m = data_metrics(**args)
    assert "critic/acc/mean" not in m
    assert m["response_length/clip_ratio"] == 0.0
    with pytest.raises(ValueError, match="advantages has 3 values but scores has 2"):
        data_metrics(**{**args, "advantages": torch.tensor([1.0, 0.0, -1.0])})
    with pytest.raises(ValueError, match="scores must be a non-empty 1-D tensor"):
        data_metrics(**{**args, "scores": torch.zeros(2, 1)})


def test_mean_metrics_averages_each_key_where_present():
    steps = [
        {"actor/pg_loss": 1.0, "actor/grad_norm": 2.0},
        {"actor/pg_loss": 3.0},
        {"actor/pg_loss": 5.0, "actor/grad_norm": 4.0, "actor/clipfrac": 0.25},
    ]
    assert mean_metrics(steps) == {"actor/pg_loss": 3.0, "actor/grad_norm": 3.0, "actor/clipfrac": 0.25}
    assert mean_metrics([]) == {}


def test_timer_accumulates_nested_and_repeated_sections(monkeypatch):
    clock = iter([0.0, 1.0, 3.0, 4.0, 4.5, 10.0])  # perf_counter readings, in call order
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    timer = Timer()
    with timer("step"):  # 0.0
        with timer("gen"):  # 1.0 .. 3.0
            pass
        with timer("gen"):  # 4.0 .. 4.5
            pass
    # step ends at 10.0
    assert timer.timings == {"timing_s/gen": 2.5, "timing_s/step": 10.0}


def test_timer_records_a_section_that_raises():
    timer = Timer()
    with pytest.raises(RuntimeError):
        with timer("update_actor"):
            raise RuntimeError("boom")
    assert timer.timings["timing_s/update_actor"] >= 0.0


def test_throughput_is_tokens_per_second_per_device():
    assert throughput_metrics(total_tokens=12_000, step_seconds=2.5, world_size=8) == {
        "perf/total_num_tokens": 12_000,
        "perf/time_per_step": 2.5,
        "perf/throughput": 600.0,
    }
    with pytest.raises(ValueError, match="step_seconds"):
        throughput_metrics(total_tokens=1, step_seconds=0.0, world_size=1)


def test_moe_load_balanced_layers_give_imbalance_one_and_cv_zero():
    m = moe_load_metrics(torch.full((3, 8), 5))
    assert m == pytest.approx(
        {"moe/load_imbalance_mean": 1.0, "moe/load_imbalance_max": 1.0, "moe/load_cv": 0.0, "moe/dead_expert_frac": 0.0}
    )


def test_moe_load_skewed_layers_and_dead_expert():
    counts = torch.tensor(
        [
            [4, 0, 2, 2],  # mean 2, max 4 -> 2.0; std sqrt((4+4+0+0)/4) = sqrt(2) -> cv 0.7071; one dead
            [3, 1, 3, 1],  # mean 2, max 3 -> 1.5; std 1 -> cv 0.5
            [0, 0, 0, 0],  # no tokens (another pipeline stage's layer): skipped
        ]
    )
    m = moe_load_metrics(counts)
    assert m == pytest.approx(
        {
            "moe/load_imbalance_mean": 1.75,
            "moe/load_imbalance_max": 2.0,
            "moe/load_cv": (2**0.5 / 2 + 0.5) / 2,
            "moe/dead_expert_frac": 1 / 8,
        }
    )


def test_moe_load_without_tokens_is_empty_and_bad_shapes_are_rejected():
    assert moe_load_metrics(torch.zeros(2, 4)) == {}
    assert moe_load_metrics(torch.zeros(0, 4)) == {}
    with pytest.raises(ValueError, match=r"2-D tensor \[layers, experts\]"):
        moe_load_metrics(torch.ones(4))
    with pytest.raises(ValueError, match="negative"):
        moe_load_metrics(torch.tensor([[1, -1]]))


def test_memory_metrics_on_cpu_is_peak_rss_in_gb():
    m = memory_metrics("cpu")
    assert list(m) == ["perf/max_memory_allocated_gb"]
    # This process holds torch: its peak RSS is well above 10 MB and below the machine's RAM.
    assert 0.01 < m["perf/max_memory_allocated_gb"] < 1024
    with pytest.raises(ValueError, match="unsupported device 'tpu'"):
        memory_metrics("tpu")
