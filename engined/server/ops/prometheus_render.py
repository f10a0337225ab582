"""The vLLM families as rows, rendered either as prometheus_client metrics or as text directly.

A scrape of an 8-rank daemon is ~2,700 lines, and prometheus_client's encoders format each
line anew (labels sorted, escaped and joined, the name checked for its escaping): ~13 ms on
the daemon's event loop, which paced ranks feel. Every line's text up to its value is the same
from one scrape to the next, so `TextRenderer` builds it once per series and a scrape only
formats the values: the same bytes as prometheus_client's encoders (tests compare them for
every `Accept` they distinguish), in a tenth of the time.

A family is a `Family` (engined.server.ops.prometheus_families) and its rows: `(label values,
value)` for gauges and counters, `(label values, histogram)` for histograms. `to_metric` makes the
same a prometheus_client `Metric`, for the registry's own encoders.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate
from typing import TypeAlias

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from engined.server.ops.prometheus_families import Family, LatencyHistogram

_go_float: Callable[[float], str] = floatToGoString
# What a label name may not hold (our names never start with a digit).
_NOT_LABEL_RUNE = re.compile(r"[^a-zA-Z0-9_]")


Row: TypeAlias = tuple[tuple[str, ...], float]
Rows: TypeAlias = Sequence[Row]
HistogramRows: TypeAlias = Sequence[tuple[tuple[str, ...], LatencyHistogram]]


def to_metric(family: Family, rows: Rows | HistogramRows) -> Metric:
    """The family as a prometheus_client metric."""
    metric: Metric
    if family.kind == "histogram":
        histogram = HistogramMetricFamily(family.name, family.documentation, labels=family.labels)
        for values, tally in rows:
            assert isinstance(tally, LatencyHistogram)
            histogram.add_metric(list(values), tally.cumulative(), tally.sum)
        return histogram
    if family.kind == "counter":
        metric = CounterMetricFamily(family.name, family.documentation, labels=family.labels)
    else:
        metric = GaugeMetricFamily(family.name, family.documentation, labels=family.labels)
    for values, value in rows:
        assert not isinstance(value, LatencyHistogram)
        metric.add_metric(list(values), value)
    return metric


def _value(value: float) -> str:
    """`floatToGoString`, with the common case (a small count) spelled without it."""
    if type(value) is int and 0 <= value < 1_000_000:
        return f"{value}.0"
    return _go_float(value)


def _label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _label_text(names: Iterable[str], values: Iterable[str]) -> str:
    """`{a="x",b="y"}`, sorted by name, as both encoders spell labels."""
    pairs = sorted(zip(names, values, strict=True))
    return "{" + ",".join(f'{name}="{_label_value(value)}"' for name, value in pairs) + "}"


class TextRenderer:
    """Renders families as the Prometheus text format or OpenMetrics, with each series' text
    before its value kept from the first scrape that had it."""

    def __init__(self) -> None:
        self._headers: dict[tuple[str, bool], str] = {}
        self._prefixes: dict[tuple[str, tuple[str, ...], bool], tuple[str, ...]] = {}

    def render(
        self,
        families: Iterable[tuple[Family, Rows | HistogramRows]],
        openmetrics: bool,
        underscored: bool = False,
    ) -> str:
        """The families' text; OpenMetrics without its `# EOF` line (the caller ends it).

        `underscored`: sample names spelled as prometheus_client's OpenMetrics encoder spells
        them under its default `escaping=underscores`, every character a label name may not
        have (the colon of `vllm:`) as `_`; its `# HELP` and `# TYPE` lines keep the colon.
        """
        out: list[str] = []
        append = out.append
        for family, rows in families:
            append(self._header(family, openmetrics))
            histogram = family.kind == "histogram"
            for values, value in rows:
                if histogram:
                    assert isinstance(value, LatencyHistogram)
                    prefixes = self._series(family, values, value.les, underscored)
                    cumulative = list(accumulate(value.counts))
                    for prefix, running in zip(prefixes[:-2], cumulative, strict=True):
                        append(f"{prefix}{_value(running)}\n")
                    append(f"{prefixes[-2]}{_value(cumulative[-1])}\n")
                    append(f"{prefixes[-1]}{_value(value.sum)}\n")
                else:
                    assert not isinstance(value, LatencyHistogram)
                    prefixes = self._series(family, values, (), underscored)
                    append(f"{prefixes[0]}{_value(value)}\n")
        return "".join(out)

    def _header(self, family: Family, openmetrics: bool) -> str:
        key = (family.name, openmetrics)
        header = self._headers.get(key)
        if header is None:
            header = self._headers[key] = _header(family, openmetrics)
        return header

    def _series(
        self, family: Family, values: tuple[str, ...], les: tuple[str, ...], underscored: bool
    ) -> tuple[str, ...]:
        key = (family.name, values, underscored)
        prefixes = self._prefixes.get(key)
        if prefixes is None:
            name = _NOT_LABEL_RUNE.sub("_", family.name) if underscored else family.name
            prefixes = self._prefixes[key] = _prefixes(family, name, values, les)
        return prefixes


def _header(family: Family, openmetrics: bool) -> str:
    """`# HELP` and `# TYPE`: OpenMetrics names the family, the text format a counter's
    samples (`_total`), and each escapes the help text its own way."""
    name = family.name
    doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
    if openmetrics:
        doc = doc.replace('"', r"\"")
    elif family.kind == "counter":
        name += "_total"
    return f"# HELP {name} {doc}\n# TYPE {name} {family.kind}\n"


def _prefixes(
    family: Family, name: str, values: tuple[str, ...], les: tuple[str, ...]
) -> tuple[str, ...]:
    """Each line's text before its value, its samples named after `name`: a counter's or
    gauge's one line; a histogram's buckets (`les`), then `_count`, then `_sum`."""
    labels = family.labels
    if family.kind == "counter":
        return (f"{name}_total{_label_text(labels, values)} ",)
    if family.kind == "gauge":
        return (f"{name}{_label_text(labels, values)} ",)
    plain = _label_text(labels, values)
    buckets = [f"{name}_bucket{_label_text((*labels, 'le'), (*values, le))} " for le in les]
    return (*buckets, f"{name}_count{plain} ", f"{name}_sum{plain} ")
