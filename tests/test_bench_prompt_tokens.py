"""`relocator bench relocation --prompt-tokens N` (issue 29): each client's long prompt is
deterministic, its own, and about N tokens with the tiny model's tokenizer; a context the
model cannot hold (or a KV pool too small for the streams) is refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from relocator.cluster.streams import PROMPTS, long_prompt, prompts_for


@pytest.fixture(scope="module")
def count(tiny_model_dir: Path):
    from relocator.cli.bench_relocation import token_counter

    return token_counter(tiny_model_dir)


def test_long_prompts_are_the_same_every_time_and_differ_between_clients(count) -> None:
    a = prompts_for(8, 1500, count)
    assert a == prompts_for(8, 1500, count)
    assert len(set(a)) == 8
    # no two clients share a first word run long enough to be a common cached prefix
    assert len({p[:40] for p in a}) == 8
    assert long_prompt(3, 1500) == long_prompt(3, 1500)  # the guess without a tokenizer too


@pytest.mark.parametrize("n", [50, 1500, 4000])
def test_a_long_prompt_is_about_n_tokens_and_never_more(count, n: int) -> None:
    for client in range(3):
        got = count(long_prompt(client, n, count))
        assert n - 7 <= got <= n, (client, n, got)  # short of n by less than one word (<= 7 tokens)
    if n >= 1500:  # no tokenizer: TOKENS_PER_WORD's guess, within a fifth on a long text
        guessed = count(long_prompt(0, n))
        assert 0.8 * n <= guessed <= 1.2 * n, (n, guessed)


def test_without_prompt_tokens_the_prompts_are_the_short_built_in_ones() -> None:
    assert prompts_for(12) == [PROMPTS[i % len(PROMPTS)] for i in range(12)]


def test_a_prompt_of_no_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="1 or more"):
        long_prompt(0, 0)


def test_the_plan_sets_the_context_only_when_the_default_is_short(tiny_model_dir: Path, count) -> None:
    from relocator.cli.bench_relocation import model_limits, plan_context

    limit, per_token = model_limits(tiny_model_dir)
    assert limit == 4096 and per_token > 0
    assert plan_context(1500, 128, 8, 0, tiny_model_dir, count).max_model_len is None  # 2048 holds it
    long = plan_context(4000, 96, 8, 0, tiny_model_dir, count)
    assert long.max_model_len == limit
    assert long.kv_cache_needed_mb == round(8 * 4096 * per_token / 2**20, 2)


def test_the_worker_spec_takes_its_context_length_from_the_environment(monkeypatch, tiny_model_dir: Path) -> None:
    from relocator.worker import ENV_MAX_MODEL_LEN, default_spec

    monkeypatch.delenv(ENV_MAX_MODEL_LEN, raising=False)
    assert default_spec(tiny_model_dir).max_model_len == 2048
    monkeypatch.setenv(ENV_MAX_MODEL_LEN, "4096")
    assert default_spec(tiny_model_dir).max_model_len == 4096
    monkeypatch.setenv(ENV_MAX_MODEL_LEN, "lots")
    with pytest.raises(ValueError, match=ENV_MAX_MODEL_LEN):
        default_spec(tiny_model_dir)


def _refused(monkeypatch, args: list[str]) -> str:
    """The CLI's one-line error for `args`; fails if it got as far as starting a cluster."""
    from typer.testing import CliRunner

    import relocator
    from relocator.cli import _register, app

    def no_cluster(*a, **k):
        raise AssertionError("the bench started a cluster for a context it should refuse")

    monkeypatch.setattr(relocator, "start", no_cluster)
    monkeypatch.delenv("RELOCATOR_DEBUG", raising=False)
    _register()
    res = CliRunner().invoke(app, ["bench", "relocation", *args])
    assert res.exit_code != 0, res.output
    assert "Traceback" not in res.output and "AssertionError" not in res.output, res.output
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert lines and lines[0].startswith("error: "), res.output
    return " ".join(lines)


def test_the_cli_refuses_a_context_the_model_cannot_hold(monkeypatch, tiny_model_dir: Path) -> None:
    msg = _refused(monkeypatch, ["--prompt-tokens", "4000", "--max-tokens", "256", "--cluster-dir", "/nonexistent"])
    assert "4256 tokens" in msg and "4096" in msg, msg
    assert "--max-tokens 96 or fewer" in msg and "--prompt-tokens 3840 or fewer" in msg, msg


def test_the_cli_refuses_a_kv_pool_too_small_for_the_streams(monkeypatch, tiny_model_dir: Path) -> None:
    msg = _refused(monkeypatch, ["--prompt-tokens", "4000", "--max-tokens", "64", "--kv-pool-mb", "1"])
    assert "--kv-pool-mb 1" in msg and "MB of KV cache" in msg, msg


def test_the_cli_refuses_a_prompt_of_no_tokens(monkeypatch) -> None:
    from typer.testing import CliRunner

    from relocator.cli import _register, app

    _register()
    res = CliRunner().invoke(app, ["bench", "relocation", "--prompt-tokens", "0"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
