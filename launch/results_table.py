"""Regenerate the README's results table from the committed study reports.

    python -m launch.results_table            # rewrites the block between the markers
    python -m launch.results_table --check    # exits 1 if README.md's block is out of date

Rows: docs/results/table.json; verdicts: each listed folder's comparison.json (see
jaxagent.eval.results_table).
"""

import argparse
import pathlib
import sys

from jaxagent.eval import results_table

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true",
                      help="only check that README.md's block is what would be written")
  parser.add_argument("--root", default=str(ROOT), help="the repository root")
  args = parser.parse_args(argv)
  root = pathlib.Path(args.root)
  readme = (root / "README.md").read_text(encoding="utf-8")
  want = results_table.replace_block(readme, results_table.render(root))
  if args.check:
    if want != readme:
      print("README.md's results table is out of date: run python -m launch.results_table",
            file=sys.stderr)
      return 1
    return 0
  if want != readme:
    (root / "README.md").write_text(want, encoding="utf-8")
  print("README.md results table " + ("rewritten" if want != readme else "already up to date"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
