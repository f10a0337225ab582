"""`python -m engined.dynamo`: the same as `engined dynamo-worker`."""

from __future__ import annotations

import sys

from engined.dynamo.cluster import serve_per_rank
from engined.dynamo.worker import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], serve_per_rank=serve_per_rank))
