"""JAX-native multi-turn tool-use environments, chosen by name.

    env = jaxagent.envs.make("lookup", tokenizer, hops=3)   # an HF tokenizer, or a TextCodec
    jaxagent.envs.names()                                   # the registered names

See `base.py` for the environment contract, `codec.py` for the text codec and `common.py` for the
parsing / budget helpers every environment shares.
"""

from __future__ import annotations

import importlib

from jaxagent.envs.base import ErrorKind, StepInfo, TokenBuffer  # noqa: F401
from jaxagent.envs.codec import TextCodec

# name -> "module:Class". The class is built as Class(codec, **difficulty). One line per family;
# modules are imported on first use.
_REGISTRY: dict[str, str] = {
    "lookup": "jaxagent.envs.lookup:LookupEnv",
    "arithmetic": "jaxagent.envs.arithmetic:ArithmeticEnv",
    "grid": "jaxagent.envs.grid:GridEnv",
    "workshop": "jaxagent.envs.workshop:WorkshopEnv",
    "sokoban": "jaxagent.envs.sokoban:SokobanEnv",
}


def names() -> list[str]:
  """The registered environment names, sorted."""
  return sorted(_REGISTRY)


def codec_for(tokenizer) -> TextCodec:
  """`tokenizer` itself if it is a `TextCodec`, else a new `TextCodec` of that Hugging Face
  tokenizer (not cached: build the environment, or the codec, once and reuse it)."""
  if isinstance(tokenizer, TextCodec):
    return tokenizer
  return TextCodec.from_tokenizer(tokenizer)


def make(name: str, tokenizer, **difficulty):
  """Builds the environment `name` for `tokenizer` (an HF tokenizer or a `TextCodec`).

  `difficulty` are the family's knobs (see each family's class docstring); unknown knobs raise
  TypeError from the constructor.
  """
  if name not in _REGISTRY:
    raise ValueError(f"unknown environment {name!r}; registered: {', '.join(names())}")
  module, cls = _REGISTRY[name].split(":")
  return getattr(importlib.import_module(module), cls)(codec_for(tokenizer), **difficulty)
