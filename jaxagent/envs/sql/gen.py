"""Offline generation of the `sql` task pool: small relational databases and questions whose gold
answer is a gold query's result on that database. Plain Python (random, sqlite3), deterministic
per seed.

A database is one of four domains (shop, library, clinic, school), each four related tables
(ids, a name or title, categorical and numeric columns, foreign keys) with tens to hundreds of
rows drawn from realistic name pools. Questions come from templates over a domain's schema,
grouped by the number of tables the gold query reads (`tables`):
  1 table:  a count with a condition, an aggregate (max/min/avg/total), the row with the
            highest/lowest value, a count above the average (nested), a count of groups (HAVING);
  2 tables: a count or total for one named entity (a join), the entity with the most rows (join,
            GROUP BY), a count over a condition on the joined table, entities with no rows (NOT IN);
  3 tables: a count over two joins (a fact and two dimensions, or a chain of two foreign keys),
            the entity with the most rows under a condition on a third table.
Every gold answer is one value (one row, one column): a count, a number (averages and money
totals rounded to 2 decimals by the gold query), or a name. Questions whose answer is NULL or
tied (argmax templates) are redrawn, and so are counts of zero (but for "no rows" questions).
"""

from __future__ import annotations

import dataclasses
import random
import sqlite3

FIRST = """Ana Ben Carla Dev Elena Farid Grace Hiro Ines Jonas Kofi Lena Marco Nadia Omar Priya
Quentin Rosa Sven Tara Umar Vera Wei Ximena Yusuf Zoe Amir Bianca Chen Dora Emil Fatima Goran Hana
Ivan Julia Kenji Lucia Mateo Nina""".split()
LAST = """Lopez Smith Kim Patel Rossi Novak Garcia Chen Muller Silva Okafor Jensen Haddad Ivanova
Tanaka Costa Dubois Nguyen Berg Moreau Khan Weber Santos Eriksen Adeyemi Rahman Bauer
Ortiz""".split()
CITIES = """Lyon Porto Leeds Kyoto Austin Lagos Quito Graz Perth Turin Bergen Dakar Malmo
Cusco""".split()
COUNTRIES = "France Japan Brazil Kenya Canada Norway India Italy Chile Egypt".split()
ADJ = """Silent Golden Hidden Broken Quiet Northern Last Bright Winter Crimson Little Distant Iron
Wild Paper""".split()
NOUN = """River Garden Mirror Harbor Forest Letter Window Bridge Engine Island Lantern Orchard
Mountain Station Voyage""".split()
PRODUCT = """Kettle Lamp Backpack Blender Notebook Umbrella Headphones Mug Chair Jacket Scarf
Speaker Toaster Pillow Bottle Wallet""".split()
COLOR = "Blue Red Green Black White Grey Amber Teal".split()
SUBJECT = """Algebra Biology Chemistry History Poetry Physics Statistics Geography Economics
Drawing Music Robotics""".split()


def _person(rng, n):
  return rng.sample([f"{f} {l}" for f in FIRST for l in LAST], n)


def _pool(fn):
  return lambda rng, n: rng.sample(fn(), n)


LABELS = {
    "person": _person,
    "product": _pool(lambda: [f"{c} {p}" for c in COLOR for p in PRODUCT]),
    "title": _pool(lambda: [f"The {a} {n}" for a in ADJ for n in NOUN]),
    "course": _pool(lambda: [f"{lv} {s}" for lv in ("Intro to", "Advanced", "Applied")
                             for s in SUBJECT]),
    "clinic": _pool(lambda: [f"{c} {k}" for c in CITIES for k in ("Health Center", "Clinic")]),
}


@dataclasses.dataclass(frozen=True)
class Col:
  """A column: kind is label (unique name or title), cat (a value from `arg`), int (range
  `arg`), money (REAL, 2 decimals, range `arg`), date (TEXT 'YYYY-MM-DD', year range `arg`) or
  fk (the id of a row of table `arg`)."""
  name: str
  kind: str
  arg: object

  @property
  def noun(self) -> str:
    return self.name.replace("_", " ")

  @property
  def sql_type(self) -> str:
    types = {"label": "TEXT", "cat": "TEXT", "date": "TEXT", "money": "REAL"}
    return types.get(self.kind, "INTEGER")


@dataclasses.dataclass(frozen=True)
class Table:
  name: str
  singular: str
  cols: tuple
  rows: tuple   # (min, max) row count

  def col(self, kind: str) -> list[Col]:
    return [c for c in self.cols if c.kind == kind]

  @property
  def label(self) -> Col | None:
    return next(iter(self.col("label")), None)

  @property
  def alias(self) -> str:
    """Its alias in the gold queries: the initials of its name (order_items -> oi)."""
    return "".join(w[0] for w in self.name.split("_"))


def _t(name, singular, rows, *cols):
  return Table(name, singular, tuple(Col(*c) for c in cols), rows)


DOMAINS = {
    "shop": (
        _t("customers", "customer", (20, 40), ("name", "label", "person"), ("city", "cat", CITIES),
           ("joined_year", "int", (2015, 2024))),
        _t("products", "product", (15, 30), ("name", "label", "product"),
           ("category", "cat", "kitchen garden office travel sports toys".split()),
           ("price", "money", (3, 250))),
        _t("orders", "order", (40, 120), ("customer_id", "fk", "customers"),
           ("order_date", "date", (2023, 2024)),
           ("status", "cat", "shipped pending cancelled returned".split())),
        _t("order_items", "order item", (80, 250), ("order_id", "fk", "orders"),
           ("product_id", "fk", "products"), ("quantity", "int", (1, 6)))),
    "library": (
        _t("authors", "author", (10, 20), ("name", "label", "person"),
           ("country", "cat", COUNTRIES),
           ("birth_year", "int", (1940, 1995))),
        _t("books", "book", (30, 60), ("title", "label", "title"), ("author_id", "fk", "authors"),
           ("genre", "cat", "mystery fantasy history poetry science romance".split()),
           ("pages", "int", (90, 900)), ("year", "int", (1970, 2024))),
        _t("members", "member", (20, 40), ("name", "label", "person"), ("city", "cat", CITIES),
           ("joined_year", "int", (2010, 2024))),
        _t("loans", "loan", (60, 200), ("book_id", "fk", "books"), ("member_id", "fk", "members"),
           ("loan_date", "date", (2023, 2024)), ("days", "int", (1, 45)))),
    "clinic": (
        _t("clinics", "clinic", (3, 6), ("name", "label", "clinic"), ("city", "cat", CITIES)),
        _t("doctors", "doctor", (8, 16), ("name", "label", "person"),
           ("specialty", "cat", "cardiology dermatology pediatrics neurology oncology".split()),
           ("clinic_id", "fk", "clinics"), ("hire_year", "int", (2000, 2024))),
        _t("patients", "patient", (30, 60), ("name", "label", "person"),
           ("birth_year", "int", (1940, 2020)), ("city", "cat", CITIES)),
        _t("visits", "visit", (80, 200), ("patient_id", "fk", "patients"),
           ("doctor_id", "fk", "doctors"), ("visit_date", "date", (2023, 2024)),
           ("cost", "money", (20, 400)),
           ("diagnosis", "cat", "flu migraine asthma fracture allergy checkup".split()))),
    "school": (
        _t("teachers", "teacher", (6, 12), ("name", "label", "person"),
           ("department", "cat", "science arts languages mathematics".split())),
        _t("courses", "course", (12, 25), ("title", "label", "course"),
           ("teacher_id", "fk", "teachers"), ("credits", "int", (1, 6)),
           ("level", "cat", "beginner intermediate expert".split())),
        _t("students", "student", (30, 60), ("name", "label", "person"), ("city", "cat", CITIES),
           ("enroll_year", "int", (2018, 2024))),
        _t("enrollments", "enrollment", (80, 200), ("student_id", "fk", "students"),
           ("course_id", "fk", "courses"), ("term", "cat", "spring summer fall".split()),
           ("score", "int", (40, 100)))),
}
DOMAIN_NAMES = tuple(DOMAINS)


@dataclasses.dataclass(frozen=True)
class Question:
  text: str
  sql: str            # the gold query
  tables: tuple       # the tables it reads, in the order the oracle describes them
  answer: str         # its single value, as the query tool prints it


def build_database(rng: random.Random, domain: str) -> sqlite3.Connection:
  """An in-memory database of `domain` with random rows (ids 1..n; values from the pools)."""
  conn = sqlite3.connect(":memory:")
  sizes = {}
  for t in DOMAINS[domain]:
    cols = ", ".join(f"{c.name} {c.sql_type}"
                     + (f" REFERENCES {c.arg}(id)" if c.kind == "fk" else "") for c in t.cols)
    conn.execute(f"CREATE TABLE {t.name} (id INTEGER PRIMARY KEY, {cols})")
    n = rng.randint(*t.rows)
    sizes[t.name] = n
    columns = []
    for c in t.cols:
      if c.kind == "label":
        columns.append(LABELS[c.arg](rng, n))
      elif c.kind == "cat":
        values = rng.sample(c.arg, min(len(c.arg), rng.randint(3, 6)))
        columns.append([rng.choice(values) for _ in range(n)])
      elif c.kind == "int":
        columns.append([rng.randint(*c.arg) for _ in range(n)])
      elif c.kind == "money":
        columns.append([round(rng.uniform(*c.arg), 2) for _ in range(n)])
      elif c.kind == "date":
        columns.append([f"{rng.randint(*c.arg)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
                        for _ in range(n)])
      else:
        columns.append([rng.randint(1, sizes[c.arg]) for _ in range(n)])
    marks = ", ".join("?" * (len(t.cols) + 1))
    conn.executemany(f"INSERT INTO {t.name} VALUES ({marks})",
                     [(i + 1, *row) for i, row in enumerate(zip(*columns))])
  conn.commit()
  return conn


def show_value(v) -> str:
  """A result cell as the query tool prints it (and as gold answers are stored)."""
  if v is None:
    return "NULL"
  if isinstance(v, float):
    return repr(round(v, 6))
  if isinstance(v, bytes):
    return "x'" + v.hex() + "'"
  return str(v)


def _q(v) -> str:
  return "'" + str(v).replace("'", "''") + "'"


class _Maker:
  """Draws questions of one database from the templates (`make(k)`: k tables read)."""

  def __init__(self, rng: random.Random, domain: str, conn: sqlite3.Connection):
    self.rng, self.conn = rng, conn
    self.tables = {t.name: t for t in DOMAINS[domain]}
    self.links = [(f, c, self.tables[c.arg]) for f in self.tables.values() for c in f.col("fk")]

  def value(self, t: Table, c: Col):
    return self.rng.choice([r[0] for r in self.conn.execute(f"SELECT {c.name} FROM {t.name}")])

  def one(self, sql: str):
    rows = self.conn.execute(sql).fetchall()
    return rows[0][0] if len(rows) == 1 and len(rows[0]) == 1 else None

  def unique_top(self, sql_top2: str) -> bool:
    rows = self.conn.execute(sql_top2).fetchall()
    return len(rows) == 1 or (len(rows) == 2 and rows[0][1] != rows[1][1])

  def make(self, k: int) -> Question | None:
    return (self.t1, self.t2, self.t3)[k - 1]()

  def t1(self):
    r = self.rng
    t = r.choice([t for t in self.tables.values()
                  if t.col("cat") or t.col("int") or t.col("money")])
    nums, cats = t.col("int") + t.col("money"), t.col("cat")
    kind = r.choice(["count", "agg", "top", "above", "having"])
    if kind == "count" and cats:
      c = r.choice(cats)
      v = self.value(t, c)
      return (f"How many {t.name} have {c.noun} {_q(v)}?",
              f"SELECT COUNT(*) FROM {t.name} WHERE {c.name} = {_q(v)}")
    if kind == "agg" and nums:
      n = r.choice(nums)
      agg, word = r.choice([("MAX", "highest"), ("MIN", "lowest"), ("AVG", "average"),
                            ("SUM", "total")])
      expr = f"{agg}({n.name})"
      expr = f"ROUND({expr}, 2)" if agg == "AVG" or n.kind == "money" else expr
      if cats and r.random() < 0.6:
        c = r.choice(cats)
        v = self.value(t, c)
        return (f"What is the {word} {n.noun} of the {t.name} with {c.noun} {_q(v)}?",
                f"SELECT {expr} FROM {t.name} WHERE {c.name} = {_q(v)}")
      return f"What is the {word} {n.noun} of all {t.name}?", f"SELECT {expr} FROM {t.name}"
    if kind == "top" and nums and t.label:
      n, (order, word) = r.choice(nums), r.choice([("DESC", "highest"), ("ASC", "lowest")])
      base = f"FROM {t.name} ORDER BY {n.name} {order} LIMIT"
      if not self.unique_top(f"SELECT {t.label.name}, {n.name} {base} 2"):
        return None
      return (f"Which {t.singular} has the {word} {n.noun}? Give its {t.label.noun}.",
              f"SELECT {t.label.name} {base} 1")
    if kind == "above" and nums:
      n = r.choice(nums)
      return (f"How many {t.name} have a {n.noun} above the average {n.noun} of all {t.name}?",
              f"SELECT COUNT(*) FROM {t.name} WHERE {n.name} > "
              f"(SELECT AVG({n.name}) FROM {t.name})")
    if kind == "having" and t.col("fk"):
      c, m = r.choice(t.col("fk")), r.randint(1, 4)
      return (f"How many different {c.name} values appear in more than {m} {t.name}?",
              f"SELECT COUNT(*) FROM (SELECT {c.name} FROM {t.name} GROUP BY {c.name} "
              f"HAVING COUNT(*) > {m})")
    return None

  def t2(self):
    r = self.rng
    f, fk, d = r.choice([x for x in self.links if x[2].label])
    lab, fa, da = d.label, f.alias, d.alias
    join = f"FROM {f.name} {fa} JOIN {d.name} {da} ON {fa}.{fk.name} = {da}.id"
    nums = f.col("int") + f.col("money")
    kind = r.choice(["count", "top", "sum", "cond", "none"])
    if kind == "count" or (kind == "sum" and not nums):
      x = self.value(d, lab)
      return (f"How many {f.name} belong to the {d.singular} with {lab.noun} {_q(x)}?",
              f"SELECT COUNT(*) {join} WHERE {da}.{lab.name} = {_q(x)}")
    if kind == "sum":
      n, x = r.choice(nums), self.value(d, lab)
      expr = f"ROUND(SUM({fa}.{n.name}), 2)" if n.kind == "money" else f"SUM({fa}.{n.name})"
      return (f"What is the total {n.noun} of the {f.name} of the {d.singular} with {lab.noun} "
              f"{_q(x)}?", f"SELECT {expr} {join} WHERE {da}.{lab.name} = {_q(x)}")
    if kind == "top":
      base = f"{join} GROUP BY {da}.id ORDER BY COUNT(*) DESC LIMIT"
      if not self.unique_top(f"SELECT {da}.{lab.name}, COUNT(*) {base} 2"):
        return None
      return (f"Which {d.singular} has the most {f.name}? Give its {lab.noun}.",
              f"SELECT {da}.{lab.name} {base} 1")
    if kind == "cond" and d.col("cat"):
      c = r.choice(d.col("cat"))
      v = self.value(d, c)
      return (f"How many {f.name} belong to {d.name} with {c.noun} {_q(v)}?",
              f"SELECT COUNT(*) {join} WHERE {da}.{c.name} = {_q(v)}")
    if kind == "none":
      return (f"How many {d.name} have no {f.name} at all?",
              f"SELECT COUNT(*) FROM {d.name} WHERE id NOT IN (SELECT {fk.name} FROM {f.name})")
    return None

  def t3(self):
    r = self.rng
    # A fact with two dimensions (F -> A, F -> B), or a chain (F -> A -> B).
    shapes = [(f, a, b, False) for f, a, _ in self.links for g, b, _ in self.links
              if g is f and a is not b]
    shapes += [(f, a, b, True) for f, a, _ in self.links for g, b, _ in self.links
               if g.name == a.arg]
    f, fa, fb, chain = r.choice(shapes)
    ta, tb = self.tables[fa.arg], self.tables[fb.arg]
    x, y, z = f.alias, ta.alias, tb.alias
    on_b = f"{y}.{fb.name}" if chain else f"{x}.{fb.name}"
    join = (f"FROM {f.name} {x} JOIN {ta.name} {y} ON {x}.{fa.name} = {y}.id "
            f"JOIN {tb.name} {z} ON {on_b} = {z}.id")
    if tb.label and (not tb.col("cat") or r.random() < 0.5):
      c = tb.label
    elif tb.col("cat"):
      c = r.choice(tb.col("cat"))
    else:
      return None
    v = self.value(tb, c)
    if ta.label and r.random() < 0.4:
      base = f"{join} WHERE {z}.{c.name} = {_q(v)} GROUP BY {y}.id ORDER BY COUNT(*) DESC LIMIT"
      if not self.unique_top(f"SELECT {y}.{ta.label.name}, COUNT(*) {base} 2"):
        return None
      cond = (f"whose {tb.singular} has {c.noun} {_q(v)}" if chain
              else f"linked to {tb.name} with {c.noun} {_q(v)}")
      return (f"Which {ta.singular} has the most {f.name} {cond}? Give its {ta.label.noun}.",
              f"SELECT {y}.{ta.label.name} {base} 1")
    if chain:
      return (f"How many {f.name} belong to {ta.name} whose {tb.singular} has {c.noun} {_q(v)}?",
              f"SELECT COUNT(*) {join} WHERE {z}.{c.name} = {_q(v)}")
    # Two dimensions: a condition on each (values of one real fact row), so all three are read.
    use_label = ta.label and (not ta.col("cat") or r.random() < 0.5)
    ca = ta.label if use_label else r.choice(ta.col("cat"))
    va, v = r.choice(self.conn.execute(f"SELECT {y}.{ca.name}, {z}.{c.name} {join}").fetchall())
    return (f"How many {f.name} link {ta.name} with {ca.noun} {_q(va)} to {tb.name} with "
            f"{c.noun} {_q(v)}?",
            f"SELECT COUNT(*) {join} WHERE {y}.{ca.name} = {_q(va)} AND {z}.{c.name} = {_q(v)}")


def make_questions(rng: random.Random, domain: str, conn: sqlite3.Connection, n: int,
                   table_counts: list[int]) -> list[Question]:
  """`n` distinct questions on `conn`, each reading k tables, k drawn from `table_counts`."""
  maker, out, seen = _Maker(rng, domain, conn), [], set()
  for _ in range(200 * n):
    if len(out) == n:
      break
    k = rng.choice(table_counts)
    made = maker.make(k)
    if made is None or made[0] in seen:
      continue
    text, sql = made
    answer = maker.one(sql)
    if answer is None or (answer == 0 and "NOT IN" not in sql):   # a count of nothing: redraw
      continue
    order = [t for t in maker.tables if f" {t} " in f" {sql} " or f" {t})" in sql]
    if len(order) != k:
      raise AssertionError(f"template read {order}, expected {k} tables: {sql}")
    seen.add(text)
    out.append(Question(text, sql, tuple(sorted(order, key=sql.index)), show_value(answer)))
  if len(out) < n:
    raise ValueError(f"could draw only {len(out)} distinct questions of {domain} with "
                     f"{table_counts} tables, not {n}; lower questions_per_database")
  return out
