"""Where and when each rank's core runs: its pass loop, inbox and pacing, here or in workers."""
