"""The config files: one checker for every setting of every file (the YAML loader, shapes,
durations, unknown keys, one error shape), the config file itself (probe targets) and its
`engines:` section. The web config file is checked with the same checker (web/)."""
