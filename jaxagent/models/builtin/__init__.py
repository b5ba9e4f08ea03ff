"""The built-in model and tokenizer, shipped inside the package (no download needed)."""

import pathlib

_HERE = pathlib.Path(__file__).parent

# name -> directory laid out like a Hugging Face checkpoint (config.json, tokenizer files).
BUILTIN_DIRS = {"tiny": _HERE / "tiny", "micro": _HERE / "micro"}
