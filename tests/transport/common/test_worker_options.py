"""The worker's launch contract: the flags the gateway writes are the flags the worker reads."""

from __future__ import annotations

import argparse

from hypothesis import given, settings
from hypothesis import strategies as st

from transport.common.worker_options import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    WorkerOptions,
    add_flags,
    option_problems,
    options_from,
    parse_host_port,
    to_flags,
)

options_st = st.builds(
    WorkerOptions,
    served_name=st.sampled_from(["", "llama", "-dash-first", "a b"]),
    max_batch=st.integers(1, 512),
    max_prefill_batch=st.integers(1, 64),
    max_prefill_tokens=st.integers(1, 1 << 16),
    max_model_len=st.integers(0, 4096),
    block_size=st.sampled_from([8, 16, 32]),
    num_blocks=st.integers(0, 4096),
    dtype=st.sampled_from(DTYPES),
    kv_cache_dtype=st.sampled_from(KV_CACHE_DTYPES),
    attention=st.sampled_from(ATTENTION_BACKENDS),
    batch_window=st.sampled_from(["adaptive", "fixed:0", "fixed:2.5"]),
    prefix_cache=st.booleans(),
    stats_interval=st.floats(0.01, 10.0),
    synthetic_step_ms=st.floats(0.0, 100.0),
    synthetic_step_ms_per_seq=st.floats(0.0, 10.0),
    synthetic_prefill_us_per_token=st.floats(0.0, 1000.0),
    synthetic_slowdown=st.floats(0.01, 100.0),
    synthetic_error_rate=st.floats(0.0, 0.5),
    synthetic_hang_rate=st.floats(0.0, 0.5),
    synthetic_error_after=st.integers(0, 100),
    synthetic_step_fail_rate=st.floats(0.0, 1.0),
    synthetic_fault_seed=st.integers(-(2**63), 2**63),
    cpus=st.sampled_from(["", "0", "0-3,6"]),
    numa_node=st.integers(-1, 3),
    metrics_listen=st.sampled_from(["", "0.0.0.0:9090", "[::1]:0"]),
)


def parse(argv: list[str]) -> WorkerOptions:
    p = argparse.ArgumentParser()
    add_flags(p)
    return options_from(p.parse_args(argv))


@settings(max_examples=50, deadline=None)
@given(options_st)
def test_to_flags_then_the_workers_parser_gives_the_same_options(o: WorkerOptions) -> None:
    assert parse(to_flags(o)) == o


def test_defaults_are_not_written_and_bad_values_are_named_by_key() -> None:
    assert to_flags(WorkerOptions()) == ["--listen=tcp://127.0.0.1:0", "--engine=jax", "--model=tiny"]
    assert parse([]) == WorkerOptions()
    bad = WorkerOptions(max_batch=0, block_size=0, dtype="float13", listen="http://x", num_blocks=-1)
    assert [key for key, _ in option_problems(bad)] == ["dtype", "listen", "max_batch", "block_size", "num_blocks"]
    assert option_problems(WorkerOptions(engine="synthetic", max_model_len=2048 * 16)) == []
    ((key, why),) = option_problems(WorkerOptions(engine="synthetic", max_model_len=2048 * 16 + 1))
    assert key == "max_model_len" and "2048 blocks x 16 tokens = 32768" in why


def test_synthetic_times_rates_and_counts_are_checked_by_key() -> None:
    bad = WorkerOptions(synthetic_step_ms=-1, synthetic_step_ms_per_seq=float("nan"),
                        synthetic_prefill_us_per_token=float("inf"), synthetic_slowdown=0,
                        synthetic_error_rate=1.01, synthetic_hang_rate=-0.5, synthetic_step_fail_rate=float("nan"),
                        synthetic_error_after=-1)  # fmt: skip
    assert [key for key, _ in option_problems(bad)] == [
        "synthetic_step_ms", "synthetic_step_ms_per_seq", "synthetic_prefill_us_per_token", "synthetic_slowdown",
        "synthetic_error_rate", "synthetic_hang_rate", "synthetic_step_fail_rate", "synthetic_error_after"]
    ((key, why),) = option_problems(WorkerOptions(synthetic_error_rate=0.7, synthetic_hang_rate=0.4))
    assert key == "synthetic_hang_rate" and "synthetic_error_rate + synthetic_hang_rate must be <= 1" in why
    assert option_problems(WorkerOptions(synthetic_error_rate=0.5, synthetic_hang_rate=0.5,
                                         synthetic_step_fail_rate=1, synthetic_slowdown=0.5)) == []  # fmt: skip


def test_metrics_listen_is_host_and_port() -> None:
    assert parse_host_port("0.0.0.0:9090") == ("0.0.0.0", 9090) and parse_host_port("[::]:0") == ("::", 0)
    for bad in ("9090", ":9090", "host:http", "host:70000"):
        ((key, why),) = option_problems(WorkerOptions(metrics_listen=bad))
        assert key == "metrics_listen" and "HOST:PORT" in why

