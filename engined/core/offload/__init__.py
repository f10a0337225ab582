"""Host (G2) and disk (G3) KV tiers below the GPU pool: mocker 1.3.0's `kvbm-offload` feature.

Glossary (one word per thing, used in every module, test and message of this package):

* **G1** the GPU block pool (`engined/core/lineage_pool.py`, owned by the KV manager);
  **G2** the host tier, **G3** the disk tier (`tier.py`). Lower tiers exist only with
  `num_g2_blocks` and `kv_bytes_per_token` (`OffloadConfig.from_args`).
* **offload** copying blocks down: G1 -> G2 when a G1 allocation evicts registered blocks,
  and G2 -> G3 in the background for every block that lands in G2.
* **lease** one offload of the blocks a single G1 allocation evicted; it holds their G1
  slots until their copy has left G1.
* **offload wait** (`OffloadWait`) an allocation waiting on an offload lease instead of
  preempting: the only name for it (upstream's `BlockedOnOffload` and dependency).
* **onboard** copying a request's missing prefix up into G1: G2 -> G1, G3 staged through G2
  first (upstream calls it swap-in: `prepare/start_onboard_prefix`).
* **parking** a waiting request taken off the queue while its onboard runs; it returns to
  the front of the queue when the onboard lands.
* **tick** advancing the tiers' virtual time to `now_ms` and applying what finished.

Layout, by level (a module's name says where it sits; tests under `tests/core/offload/` are
named the same way):

* tier engine, pure G2/G3 and links, never touching G1: `tier_engine.py` (`TierEngine`,
  upstream's `MockOffloadEngine`) built from `tier.py` (one lower tier's pool),
  `tier_onboard.py` (the engine's onboard transfers), `pipeline.py` (batched offload
  transfers), `lanes.py` and `link.py` (bandwidth-shared links); `tier_values.py` holds the values
  the engine exchanges with G1.
* G1 glue: `g1_glue.py`, owned by the KV manager and built from its pool and its event log
  (never the manager itself): evictions offered to G2, tick effects
  applied to G1, onboards landed in G1.
* scheduler: `parking.py`, the parked requests of one engine.

`config.py` is the configuration of all three.
"""
