"""vLLM's `--speculative-config` (and `--spec-*`) on `engined serve`: onto the MTP keys, with
vLLM's synthetic acceptance, refused where engined would publish what vLLM would not."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from engined.cli import CONFIG_ERROR
from engined.client import EngineClient
from tests.server.daemon_harness import start_daemon
from tests.test_cli_serve import clean_environment, invoke, printed

__all__ = ["clean_environment"]


def spec(**fields: Any) -> str:
    return json.dumps(fields)


def engine_of(*args: str) -> dict[str, Any]:
    engine: dict[str, Any] = printed(*args)["engine"]
    return engine


def test_mtp_with_synthetic_rates_sets_nextn_and_vllms_conditional_rates() -> None:
    """vLLM's rates are unconditional (all of the first i+1 drafts accepted); its sampler,
    like engined's, draws each position with the conditional rate (0.5 / 0.8, 0.3 / 0.5)."""
    engine = engine_of(
        "--speculative-config",
        spec(
            method="mtp",
            num_speculative_tokens=3,
            rejection_sample_method="synthetic",
            synthetic_acceptance_rates=[0.8, 0.5, 0.3],
        ),
    )
    assert (engine["aic_nextn"], engine["aic_nextn_accept_rates"]) == (3, "0.8,0.625,0.6")


@pytest.mark.parametrize(
    ("length", "drafts", "rates"),
    [(2.5, 2, "1,0.5"), (1.5, 3, "0.5,0,0"), (1.0, 2, "0,0"), (4.0, 3, "1,1,1")],
)
def test_synthetic_acceptance_length_is_vllms_minimum_variance_schedule(
    length: float, drafts: int, rates: str
) -> None:
    engine = engine_of(
        "-sc",
        spec(
            method="mtp",
            num_speculative_tokens=drafts,
            rejection_sample_method="synthetic",
            synthetic_acceptance_length=length,
        ),
    )
    assert (engine["aic_nextn"], engine["aic_nextn_accept_rates"]) == (drafts, rates)


@pytest.mark.parametrize(
    ("args", "nextn", "lookahead"),
    [
        (("--speculative-config", spec(method="deepseek_mtp")), 1, True),
        (("-sc", spec(method="eagle", model="/draft", num_speculative_tokens=4)), 4, True),
        (("--spec-method", "eagle3", "--spec-model", "/draft", "--spec-tokens", "2"), 2, True),
        (("--spec-method", "mtp", "--speculative-config", spec(num_speculative_tokens=3)), 3, True),
        # vLLM's parser reads `--speculative_config` as `--speculative-config`.
        (("--speculative_config", spec(method="mtp", num_speculative_tokens=2)), 2, True),
        # vLLM names the method after an EAGLE head's model when none is given.
        (("--spec-model", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "--spec-tokens", "2"), 2, True),
        # A draft model (named, or any model without a method): plain block hashes.
        (("-sc", spec(method="draft_model", model="/draft", num_speculative_tokens=3)), 3, False),
        (("--spec-model", "org/tiny-draft", "--spec-tokens", "2"), 2, False),
        # Both of vLLM's switches: its plain hashes and no trailing-block drop.
        (
            (
                "-sc",
                spec(
                    method="mtp", disable_lookahead_block_hashes=True, disable_eagle_block_drop=True
                ),
            ),
            1,
            False,
        ),
    ],
)
def test_modelled_methods_set_nextn_with_engineds_rates(
    args: tuple[str, ...], nextn: int, lookahead: bool
) -> None:
    """Without synthetic acceptance the rates are a model's: engined's own stand in. A
    draft model (plain hashes here) also takes vLLM's one drafting slot per request."""
    engine = engine_of(*args)
    default = ["0.85", "0.3", "0", "0", "0"]
    draft_model = not lookahead and "disable_eagle_block_drop" not in " ".join(args)
    assert (
        engine["aic_nextn"],
        engine["aic_nextn_accept_rates"],
        engine["lookahead_block_hashes"],
        engine["drafting_slots"],
    ) == (nextn, ",".join(default[:nextn]), lookahead, 1 if draft_model else 0)


@pytest.mark.parametrize("method", ["mtp", "eagle", "eagle3"])
def test_disabled_lookahead_hashes_alone_is_vllms_trailing_block_drop(method: str) -> None:
    engine = engine_of("-sc", spec(method=method, model="/d", disable_lookahead_block_hashes=True))
    assert (
        engine["lookahead_block_hashes"],
        engine["eagle_block_drop"],
        engine["drafting_slots"],
    ) == (False, True, 0)


@pytest.mark.parametrize(
    ("args", "what"),
    [
        (("--spec-method", "ngram", "--spec-tokens", "3"), "ngram"),
        (("--spec-model", "[ngram]", "--spec-tokens", "3"), "ngram"),
        (("--spec-model", "my_pkg.Proposer", "--spec-tokens", "3"), "custom_class"),
        (("--speculative-config", spec(method="dflash", model="/d")), "dflash"),
        (("--speculative-config", spec(model="z-lab/Qwen3-dflash-b16")), "dflash"),
        (("--speculative-config", "{}"), "no method"),
    ],
)
def test_other_methods_are_ignored_with_a_warning(args: tuple[str, ...], what: str) -> None:
    result = invoke("--print-config", *args)
    assert result.exit_code == 0, result.output
    assert "# aic_nextn = (unset)" in result.stdout
    assert result.stderr == (
        f"engined serve: ignoring --speculative-config: speculative decoding with {what} is "
        "not modelled (only mtp, eagle, eagle3 and draft_model are); running without it\n"
    )


MTP2 = {"method": "mtp", "num_speculative_tokens": 2}
SYNTHETIC = {**MTP2, "rejection_sample_method": "synthetic"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--speculative-config", spec(**MTP2, num_speculative_token=2)),
            "--speculative-config: Object contains unknown field `num_speculative_token`",
        ),
        (
            ("--speculative-config", spec(method="mtp", num_speculative_tokens="2")),
            "--speculative-config: Expected `int | null`, got `str` - at "
            "`$.num_speculative_tokens`",
        ),
        (("--speculative-config", "not json"), "--speculative-config: JSON is malformed"),
        (
            ("--speculative-config", "[2]"),
            "--speculative-config: expected a JSON object, got '[2]'",
        ),
        (
            ("--speculative-config", spec(method="mtp", num_speculative_tokens=6)),
            "--speculative-config: num_speculative_tokens must be in [1, 5] (engined's --nextn), "
            "got 6",
        ),
        (
            ("--speculative-config", spec(**MTP2, num_speculative_tokens_per_batch_size=[[1, 2]])),
            "--speculative-config: num_speculative_tokens_per_batch_size (dynamic speculative "
            "decoding) is not modelled",
        ),
        (
            ("--spec-tokens", "2", "--speculative-config", spec(**MTP2)),
            "--spec-tokens and --speculative-config['num_speculative_tokens'] are mutually "
            "exclusive",
        ),
        (
            ("--speculative-config", spec(**MTP2), "--nextn", "2"),
            "--speculative-config: also given by flag as engine.aic_nextn; set each once",
        ),
        (
            (
                "--speculative-config",
                spec(**SYNTHETIC, synthetic_acceptance_length=2),
                "--nextn-accept-rates",
                "0.5",
            ),
            "--speculative-config: also given by flag as engine.aic_nextn_accept_rates",
        ),
        (
            ("--speculative-config", spec(**MTP2, synthetic_acceptance_length=2)),
            "--speculative-config: synthetic_acceptance_rates / synthetic_acceptance_length are "
            "only valid with rejection_sample_method='synthetic'.",
        ),
        (
            ("--speculative-config", spec(**SYNTHETIC)),
            "--speculative-config: rejection_sample_method='synthetic' requires exactly one of "
            "synthetic_acceptance_rates or synthetic_acceptance_length.",
        ),
        (
            ("--speculative-config", spec(**SYNTHETIC, synthetic_acceptance_rates=[0.5])),
            "--speculative-config: synthetic_acceptance_rates must have length 2, got [0.5].",
        ),
        (
            ("--speculative-config", spec(**SYNTHETIC, synthetic_acceptance_rates=[0.5, 0.7])),
            "--speculative-config: synthetic_acceptance_rates must be non-increasing, got "
            "[0.5, 0.7].",
        ),
        (
            ("--speculative-config", spec(**SYNTHETIC, synthetic_acceptance_rates=[1.5, 0.7])),
            "--speculative-config: synthetic_acceptance_rates entries must be in [0, 1], got "
            "[1.5, 0.7].",
        ),
        (
            ("--speculative-config", spec(**SYNTHETIC, synthetic_acceptance_length=3.5)),
            "--speculative-config: synthetic_acceptance_length must be in [1, 3], got 3.5.",
        ),
    ],
)
def test_bad_or_unmodelled_settings_are_refused_by_name(
    args: tuple[str, ...], message: str
) -> None:
    result = invoke("--print-config", *args)
    assert result.exit_code == CONFIG_ERROR, result.output
    assert result.stderr.startswith("error: " + message), result.stderr


def test_a_daemon_started_with_it_accepts_every_draft(tmp_path: Path) -> None:
    """Synthetic rates of 1: after the prefill's token, every step emits the token and both
    drafts, as vLLM's synthetic sampler at rate 1 accepts them."""
    config = spec(**SYNTHETIC, synthetic_acceptance_rates=[1.0, 1.0])
    args = ("--speedup-ratio", "0", "--block-size", "16", "--speculative-config", config)

    async def scenario(control: str) -> None:
        async with await EngineClient.connect(control) as client:
            generation = await client.generate(list(range(1, 40)), 31, timeout=30)
        assert (len(generation.token_ids), generation.num_outputs) == (31, 11)
        assert generation.finish_reason == "length"

    with start_daemon(tmp_path, *args) as daemon:
        asyncio.run(asyncio.wait_for(scenario(daemon.control), 60))
