"""Pure parsers of nvidia-smi's output: `-q -x` (the XML report), `-L` (the listing)
and the snapshot built from both. Bytes in, dataclasses out; nothing runs here."""
