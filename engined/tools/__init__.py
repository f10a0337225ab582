"""The operator commands behind `engined submit|events|fpm|stats|bench`.

One module per command, each with an options dataclass and an async entry point that writes
through `engined.tools.common.Output`; `engined.cli` only parses arguments into those
dataclasses. Keeping the logic here lets tests drive a command without the command line, and
keeps the CLI module a list of options.
"""
