"""The settings clients may change while the daemon runs, and what `welcome` reports of them.

A Dynamo worker attaches to a daemon that is already serving and adapts it to the model it
registers: token ids its tokenizer decodes (`set_vocabulary`) and its own id on the
forward-pass metrics (`set_fpm_worker_id`, for every rank or, when each rank is a Dynamo
worker of its own, for one). The cores hold the vocabulary they draw from and the publishers
the id they stamp; this object keeps the daemon-wide view, so `welcome` tells every later
client what is in force (the engine-wide id: a rank's own id is its worker's to know).

An RL trainer labels the weights it loads (`set_weight_version`, vLLM's
`update_weight_version`): each rank's label is kept here, and the control server labels the
outputs it delivers for the rank with it (none: vLLM's "default", left out of the entries).
"""

from __future__ import annotations

from collections.abc import Sequence

from engined.server.ranks.rank_sinks import WorkerIdSink


class RuntimeSettings:
    def __init__(
        self,
        *,
        vocab_size: int | None,
        excluded_token_ids: Sequence[int],
        fpm_worker_id: str,
        fpm: Sequence[WorkerIdSink],
    ) -> None:
        """`fpm`: each rank's publisher (or its proxy), in rank order."""
        self._vocab_size = vocab_size
        self._excluded = tuple(excluded_token_ids)
        self._fpm_worker_id = fpm_worker_id
        self._fpm = fpm
        # By rank; a rank not here has vLLM's "default".
        self.weight_versions: dict[int, str] = {}

    @property
    def vocab_size(self) -> int | None:
        return self._vocab_size

    @property
    def excluded_token_ids(self) -> tuple[int, ...]:
        return self._excluded

    @property
    def fpm_worker_id(self) -> str:
        return self._fpm_worker_id

    def vocabulary_applied(self, vocab_size: int | None, excluded: Sequence[int]) -> None:
        """Every core accepted the vocabulary (the cores validate it; this only records it)."""
        self._vocab_size = vocab_size
        self._excluded = tuple(excluded)

    def set_fpm_worker_id(self, worker_id: str, dp_rank: int | None = None) -> None:
        """Stamp `dp_rank`'s metrics (the control server checked the rank), or every rank's."""
        if dp_rank is not None:
            self._fpm[dp_rank].worker_id = worker_id
            return
        self._fpm_worker_id = worker_id
        for publisher in self._fpm:
            publisher.worker_id = worker_id
