"""Multi-turn tool-use environments, chosen by name.

    env = jaxagent.envs.make("lookup", tokenizer, hops=3)   # an HF tokenizer, or a TextCodec
    env = jaxagent.envs.make("mypkg.mytool:MyEnv", tokenizer)   # any importable class
    jaxagent.envs.names()                                   # the registered names

A name is a registered one (`_REGISTRY`) or "package.module:Class" (bring your own environment:
docs/guides/environments.md); either is built as Class(codec, **difficulty). `resolve(name)`
gives the class without building it (the config check uses it, before any compute).

See `base.py` for the environment contract, `codec.py` for the text codec and `common.py` for the
parsing / budget helpers every environment shares.
"""

from __future__ import annotations

import importlib

from jaxagent.envs.base import ErrorKind, StepInfo, TokenBuffer  # noqa: F401
from jaxagent.envs.codec import TextCodec
from jaxagent.envs.host import HostEnv

# name -> "module:Class". The class is built as Class(codec, **difficulty). One line per family;
# modules are imported on first use.
_REGISTRY: dict[str, str] = {
    "lookup": "jaxagent.envs.lookup:LookupEnv",
    "arithmetic": "jaxagent.envs.arithmetic:ArithmeticEnv",
    "grid": "jaxagent.envs.grid:GridEnv",
    "workshop": "jaxagent.envs.workshop:WorkshopEnv",
    "sokoban": "jaxagent.envs.sokoban:SokobanEnv",
    # Host (plain Python) environments: the same contract on numpy arrays (envs/host.py).
    "host_lookup": "jaxagent.envs.host:HostLookupEnv",
    "sql": "jaxagent.envs.sql:SqlEnv",
}


def names() -> list[str]:
  """The registered environment names, sorted."""
  return sorted(_REGISTRY)


def jax_names() -> list[str]:
  """The registered JAX-native environments, sorted: those whose `step` is a pure function that
  `jit(vmap(env.step))` compiles (the others are host environments, `envs/host.py`)."""
  return [n for n in names() if not issubclass(resolve(n), HostEnv)]


def codec_for(tokenizer) -> TextCodec:
  """`tokenizer` itself if it is a `TextCodec`, else a new `TextCodec` of that Hugging Face
  tokenizer (not cached: build the environment, or the codec, once and reuse it)."""
  if isinstance(tokenizer, TextCodec):
    return tokenizer
  return TextCodec.from_tokenizer(tokenizer)


def resolve(name: str) -> type:
  """The environment class of `name`: a registered name, or "package.module:Class" (imported
  here). Raises ValueError naming the fix for an unknown name, a module that does not import or
  a class the module lacks."""
  if name in _REGISTRY:
    target = _REGISTRY[name]
  elif ":" in name:
    target = name
  else:
    raise ValueError(f"unknown environment {name!r}: use a registered name "
                     f"({', '.join(names())}) or an importable class as "
                     "'package.module:Class' (e.g. 'mypkg.mytool:MyEnv')")
  module, _, cls = target.partition(":")
  if not module or not cls or ":" in cls:
    raise ValueError(f"environment {name!r}: write an importable class as "
                     "'package.module:Class' (one colon, e.g. 'mypkg.mytool:MyEnv')")
  try:
    mod = importlib.import_module(module)
  except ImportError as e:
    raise ValueError(f"environment {name!r}: cannot import module {module!r} ({e}); install "
                     "the package or put its directory on PYTHONPATH") from e
  if not hasattr(mod, cls):
    public = sorted(k for k, v in vars(mod).items() if isinstance(v, type) and k[:1] != "_")
    raise ValueError(f"environment {name!r}: module {module!r} has no class {cls!r}; its "
                     f"classes: {', '.join(public) or 'none'}")
  return getattr(mod, cls)


def make(name: str, tokenizer, **difficulty):
  """Builds the environment `name` (`resolve`) for `tokenizer` (an HF tokenizer or a
  `TextCodec`) as Class(codec, **difficulty).

  `difficulty` are the family's knobs (see each family's class docstring); unknown knobs raise
  TypeError from the constructor.
  """
  return resolve(name)(codec_for(tokenizer), **difficulty)
