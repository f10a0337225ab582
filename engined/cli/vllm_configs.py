"""`engined serve`'s options that take vLLM's JSON configurations and land on engined's
own keys: `--kv-events-config` (the kv_events_* keys) and `--speculative-config` (`-sc`)
with its `--spec-method`, `--spec-model` and `--spec-tokens` shorthands (the MTP keys).

They are not `FLAGS` entries: one vLLM option sets several keys, each of which has its own
flag, so a key given both ways is refused rather than silently overridden.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Any

import typer

from engined.config import kv_events_flags, speculative_flags

# The parameter names `serve` receives them under: the speculative ones, and all of them.
SPECULATIVE = ("speculative_config", "spec_method", "spec_model", "spec_tokens")
NAMES = ("kv_events_config", *SPECULATIVE)


def _option(name: str, flags: tuple[str, ...], kind: type, metavar: str, help_text: str) -> Any:
    return inspect.Parameter(
        name,
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[
            kind | None,
            typer.Option(
                *flags,
                metavar=metavar,
                help=help_text,
                rich_help_panel="Engine" if name != "kv_events_config" else "Daemon",
                show_default=False,
            ),
        ],
    )


def parameters() -> list[inspect.Parameter]:
    return [
        _option(
            "kv_events_config",
            ("--kv-events-config",),
            str,
            "JSON",
            "vLLM's KVEventsConfig JSON (endpoint, replay_endpoint, topic, buffer_steps, "
            "...), mapped onto the kv_events_* keys.",
        ),
        _option(
            "speculative_config",
            ("--speculative-config", "-sc"),
            str,
            "JSON",
            "vLLM's SpeculativeConfig JSON: method mtp (or eagle, eagle3) with "
            "num_speculative_tokens sets --nextn, and synthetic_acceptance_rates or "
            "synthetic_acceptance_length (rejection_sample_method synthetic) sets "
            "--nextn-accept-rates; other methods are ignored with a warning.",
        ),
        _option("spec_method", ("--spec-method",), str, "METHOD", "Its `method`."),
        _option("spec_model", ("--spec-model",), str, "MODEL", "Its `model` (never loaded)."),
        _option("spec_tokens", ("--spec-tokens",), int, "N", "Its `num_speculative_tokens`."),
    ]


def config_keys(
    options: dict[str, Any], flags: dict[str, Any], warn: Callable[[str], None]
) -> dict[str, Any]:
    """`flags` with the keys the JSON options in `options` set (both given is refused)."""
    keys: dict[str, Any] = {}
    if options["kv_events_config"] is not None:
        keys.update(kv_events_flags(options["kv_events_config"], given=flags))
    if any(options[name] is not None for name in SPECULATIVE):
        spec_keys, warnings = speculative_flags(
            options["speculative_config"],
            method=options["spec_method"],
            model=options["spec_model"],
            tokens=options["spec_tokens"],
            given=flags,
        )
        keys.update(spec_keys)
        for warning in warnings:
            warn(warning)
    return {**keys, **flags}
