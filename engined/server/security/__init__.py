"""Who may connect to the daemon's sockets: the ZAP gatekeeper and its access settings."""
