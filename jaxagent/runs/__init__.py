"""Runs: config sections, workdir layout, set-up and compiled programs."""
