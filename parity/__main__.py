"""`python -m parity [--vllm-python P] [--scenario NAME...] [--write-table FILE] [--no-raw-hashes]`.

Prints one verdict line per scenario (`name: 12/12 steps equal`) and, for each, its first
divergence in detail; `--write-table` writes the markdown table of docs/parity.md.
"""

from __future__ import annotations

import argparse
import sys

from parity.compare import report, table
from parity.runner import VllmVenvError, run_scenarios, vllm_python
from parity.scenarios import all_scenarios

TABLE_BEGIN = "<!-- parity-table:begin (python -m parity --write-table docs/parity.md) -->"
TABLE_END = "<!-- parity-table:end -->"


def write_table(path: str, markdown: str) -> None:
    """Replace the table between the markers of `path` (the whole file if it has none)."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    block = f"{TABLE_BEGIN}\n{markdown}{TABLE_END}"
    if TABLE_BEGIN in text and TABLE_END in text:
        head, rest = text.split(TABLE_BEGIN, 1)
        tail = rest.split(TABLE_END, 1)[1]
        text = head + block + tail
    else:
        text = block + "\n"
    with open(path, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parity", description=__doc__)
    parser.add_argument("--vllm-python", help="the vLLM venv's interpreter")
    parser.add_argument("--scenario", action="append", default=[], help="run only these")
    parser.add_argument("--write-table", metavar="FILE", help="write the parity table")
    parser.add_argument(
        "--raw-hashes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare the raw block hashes too (the default; --no-raw-hashes compares blocks "
        "by the token prefix they close only)",
    )
    args = parser.parse_args(argv)
    scenarios = all_scenarios()
    known = {s.name for s in scenarios}
    unknown = [name for name in args.scenario if name not in known]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {sorted(known)}")
    if args.scenario:
        scenarios = [s for s in scenarios if s.name in args.scenario]
    try:
        python = vllm_python(args.vllm_python)
        verdicts = run_scenarios(scenarios, python, raw_hashes=args.raw_hashes)
    except VllmVenvError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for verdict in verdicts:
        print("\n".join(report(verdict)))
    if args.write_table:
        descriptions = {s.name: s.description for s in scenarios}
        write_table(args.write_table, table(verdicts, descriptions.__getitem__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
