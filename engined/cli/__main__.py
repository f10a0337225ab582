"""`python -m engined.cli`: the same program as the `engined` console script."""

from engined.cli import main

if __name__ == "__main__":
    main()
