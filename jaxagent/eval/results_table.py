"""The README's results table, generated from the committed study reports, so it cannot disagree
with them.

    python -m launch.results_table            # rewrites README.md's block
    python -m launch.results_table --check    # exits 1 if the block is not what it would write

The rows are listed in `docs/results/table.json` (in order: {"run": the row's name, "family": the
environment family it ran on, "dir": a study's report folder under docs/results/}): one table
for every family, so a claim's verdict reads across families (the generality the seed asks for). Each row's verdicts come from the folder's
`comparison.json` (`jaxagent.eval.compare`'s record: every claim's verdict, and its verdict
against the sharpened base where the comparison ran the sharpening control). A folder without a
comparison.json (reports committed before it was) is read from its `comparison.md`'s Verdicts
table, and the row says so: its numbers cannot be regenerated from data in the repository.

The block sits between `START` and `END` in README.md; nothing else of the README is touched.
"""

from __future__ import annotations

import json
import pathlib
import re

START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"
MANIFEST = "docs/results/table.json"
HEADER = ["run", "family", "1: gains only at generous T", "2: recovery > step quality",
          "3: BudgetMix robust", "4: RL trajectories likelier", "5: recovery on action errors",
          "source"]
MD_ONLY = "comparison.md (no comparison.json committed)"
_ROW = re.compile(r"^\| (\d) \| \*\*([a-z ]+)\*\* \|")


def verdicts_from_json(comp: dict) -> dict[int, str]:
  """{claim: verdict} of a comparison.json, "VERDICT (vs a sharpened base: VERDICT)" where the
  claim was also decided against the sharpened base."""
  out = {}
  for num, c in comp["claims"].items():
    sh = c.get("sharpened")
    out[int(num)] = c["verdict"] + (f" (vs a sharpened base: {sh['verdict']})" if sh else "")
  return out


def verdicts_from_markdown(text: str, where: str) -> dict[int, str]:
  """{claim: verdict} from a comparison.md's "## Verdicts" table (rows `| N | **verdict** |`).
  Raises ValueError naming the file when the section or a claim is missing."""
  if "## Verdicts" not in text:
    raise ValueError(f"{where} has no '## Verdicts' section: commit the study's comparison.json "
                     "(or its comparison.md as launch.compare wrote it)")
  section = text.split("## Verdicts", 1)[1].split("\n## ", 1)[0]
  out = {int(m[1]): m[2] for m in map(_ROW.match, section.splitlines()) if m}
  if sorted(out) != [1, 2, 3, 4, 5]:
    raise ValueError(f"{where}'s Verdicts table lists claims {sorted(out)}, not 1-5")
  return out


def row(root: pathlib.Path, entry: dict) -> list[str]:
  """One table row: the run's name linked to its comparison.md, its family, the five verdicts,
  the source."""
  if "family" not in entry:
    raise ValueError(f"the entry {entry} of {MANIFEST} names no \"family\" (the environment the "
                     "study ran on, e.g. \"grid\")")
  folder = root / "docs" / "results" / entry["dir"]
  rel = f"docs/results/{entry['dir']}/comparison.md"
  js, md = folder / "comparison.json", folder / "comparison.md"
  if js.exists():
    verdicts, source = verdicts_from_json(json.loads(js.read_text())), "comparison.json"
  elif md.exists():
    verdicts, source = verdicts_from_markdown(md.read_text(), str(md)), MD_ONLY
  else:
    raise FileNotFoundError(f"{folder} holds neither comparison.json nor comparison.md: fix the "
                            f"entry {entry} in {MANIFEST} or commit the study's report there")
  return ([f"[{entry['run']}]({rel})", entry["family"]] + [verdicts[n] for n in range(1, 6)]
          + [source])


def render(root) -> str:
  """The block (markers included) from the manifest and the reports under `root`."""
  root = pathlib.Path(root)
  entries = json.loads((root / MANIFEST).read_text())
  lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---" for _ in HEADER) + "|"]
  lines += ["| " + " | ".join(row(root, e)) + " |" for e in entries]
  return "\n".join([START] + lines + [END])


def replace_block(readme: str, block: str) -> str:
  """`readme` with the text from START to END (inclusive) replaced by `block`. Raises
  ValueError naming the fix unless both markers occur once, in order."""
  if readme.count(START) != 1 or readme.count(END) != 1 or readme.index(START) > readme.index(END):
    raise ValueError(f"README.md must hold the markers {START} and {END} once each, in this "
                     "order, around the results table")
  head, rest = readme.split(START, 1)
  return head + block + rest.split(END, 1)[1]

