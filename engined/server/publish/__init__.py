"""What a rank publishes: KV events with their replay, FPM, and their Prometheus counters."""
