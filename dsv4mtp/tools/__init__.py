"""The command-line tools: ``dsv4-mtp`` (cli), its ``demo`` main job and ``compare`` (drift)."""
