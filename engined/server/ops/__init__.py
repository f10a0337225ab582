"""What operators and the host see: Prometheus under vLLM's names, health, systemd, logs, heap."""
