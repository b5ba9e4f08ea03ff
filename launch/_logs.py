"""Quiet logs for people: keep our INFO lines, drop orbax's per-save chatter below WARNING."""

import logging as pylogging

from absl import logging


class _DropLibraryInfo(pylogging.Filter):
  NOISY = ("/orbax/", "/etils/", "/tensorflow_datasets/")

  def filter(self, record):
    return record.levelno >= pylogging.WARNING or not any(n in record.pathname for n in self.NOISY)


def quiet_libraries() -> None:
  logging.get_absl_handler().addFilter(_DropLibraryInfo())
  import tensorflow_datasets as tfds
  tfds.disable_progress_bar()
  logging.set_verbosity(logging.INFO)
