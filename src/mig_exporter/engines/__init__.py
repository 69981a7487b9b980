"""Inference engines: which processes are engines (rules, presets, how a command
line asks for a GPU), and how much GPU memory each holds where."""
