"""`python -m engined.openai`: one API server process, started by the daemon (never by hand)."""

import sys

from engined.openai.process import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
