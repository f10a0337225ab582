"""The control protocol's server side: its clients, their bounds, and their commands to ranks."""
