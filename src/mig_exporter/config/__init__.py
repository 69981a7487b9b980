"""The exporter's config file: one checker for every setting (shapes, durations, unknown
keys, one error shape), the file itself (probe targets) and its `engines:` section."""
