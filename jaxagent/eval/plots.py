"""PNG plots of evaluation results (matplotlib, Agg backend; no display needed).

Inputs are the JSON-able structures of `jaxagent.eval.report`: a Pass@(K,T) grid
{"k": [K], "t": [T], "mean"/"lo"/"hi": [K][T]}, and rate entries {"rate", "lo", "hi", "n"}.
"""

from __future__ import annotations

import pathlib
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def save(fig, path) -> str:
  """Writes `fig` to `path` as a PNG (its folder made where missing), closes it; the path."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return str(path)


def pass_heatmap(grid: dict, path, title: str = "Pass@(K,T)") -> str:
  """Heatmap of grid["mean"] [K, T] with each cell annotated."""
  mean = np.asarray(grid["mean"], float)
  k, t = list(grid["k"]), list(grid["t"])
  fig, ax = plt.subplots(figsize=(1.0 + 0.6 * len(t), 1.0 + 0.45 * len(k)))
  im = ax.imshow(mean, origin="lower", aspect="auto", vmin=0.0, vmax=1.0, cmap="viridis")
  ax.set_xticks(range(len(t)), [str(x) for x in t])
  ax.set_yticks(range(len(k)), [str(x) for x in k])
  ax.set_xlabel("T (turn budget)")
  ax.set_ylabel("K (episodes)")
  if mean.size <= 400:
    for i in range(mean.shape[0]):
      for j in range(mean.shape[1]):
        ax.text(j, i, f"{mean[i, j]:.2f}", ha="center", va="center", fontsize=7,
                color="white" if mean[i, j] < 0.5 else "black")
  fig.colorbar(im, ax=ax)
  ax.set_title(title)
  return save(fig, path)


def pass_curves(grid: dict, ks: Sequence[int], path, title: str = "Pass@(K,T) vs T") -> str:
  """Pass vs T, one line per K in `ks` (those present in the grid), with interval bands."""
  k_all, t = list(grid["k"]), np.asarray(grid["t"])
  fig, ax = plt.subplots(figsize=(6, 4))
  for k in ks:
    if k not in k_all:
      continue
    i = k_all.index(k)
    ax.plot(t, grid["mean"][i], marker="o", label=f"K={k}")
    ax.fill_between(t, grid["lo"][i], grid["hi"][i], alpha=0.2)
  ax.set_xlabel("T (turn budget)")
  ax.set_ylabel("Pass@(K,T)")
  ax.set_ylim(-0.02, 1.02)
  ax.legend()
  ax.set_title(title)
  return save(fig, path)


def pass_curves_runs(grids: dict[str, dict], k: int, path, title: str | None = None) -> str:
  """Pass@(k,T) vs T for several runs (label -> grid) on one axes."""
  fig, ax = plt.subplots(figsize=(6, 4))
  for label, grid in grids.items():
    ks = list(grid["k"])
    if k not in ks:
      continue
    i = ks.index(k)
    t = np.asarray(grid["t"])
    ax.plot(t, grid["mean"][i], marker="o", label=label)
    ax.fill_between(t, grid["lo"][i], grid["hi"][i], alpha=0.15)
  ax.set_xlabel("T (turn budget)")
  ax.set_ylabel(f"Pass@({k},T)")
  ax.set_ylim(-0.02, 1.02)
  ax.legend()
  ax.set_title(title or f"Pass@({k},T) by run")
  return save(fig, path)


def rate_bars(data: dict[str, dict[str, dict]], path, title: str, ylabel: str = "rate") -> str:
  """Grouped bars: data[policy][category] = {"rate", "lo", "hi", "n"}; one group per category,
  one bar per policy, interval as error bar (categories with no states are left empty)."""
  policies = list(data)
  cats: list[str] = []
  for p in policies:
    cats += [c for c in data[p] if c not in cats]
  fig, ax = plt.subplots(figsize=(min(14, max(5, 0.45 * len(cats) * max(1, len(policies)) + 2)),
                                  4))
  width = 0.8 / max(1, len(policies))
  x = np.arange(len(cats))
  for i, p in enumerate(policies):
    r = [data[p].get(c, {}) for c in cats]
    mean = np.array([e.get("rate") if e.get("rate") is not None else np.nan for e in r], float)
    lo = np.array([e.get("lo") if e.get("lo") is not None else np.nan for e in r], float)
    hi = np.array([e.get("hi") if e.get("hi") is not None else np.nan for e in r], float)
    err = np.stack([np.nan_to_num(mean - lo), np.nan_to_num(hi - mean)])
    ax.bar(x + (i - (len(policies) - 1) / 2) * width, np.nan_to_num(mean), width, yerr=err,
           capsize=3, label=p)
  ax.set_xticks(x, cats, rotation=20, ha="right")
  ax.set_ylim(0, 1.05)
  ax.set_ylabel(ylabel)
  ax.legend(fontsize=8)
  ax.set_title(title)
  return save(fig, path)


def matrix(values, rows: Sequence[str], cols: Sequence[str], path, title: str,
           xlabel: str = "scored under", ylabel: str = "trajectories of") -> str:
  """An annotated matrix (e.g. the cross log-likelihood matrix); None entries left blank."""
  v = np.array([[np.nan if x is None else x for x in r] for r in values], float)
  fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(cols), 1.2 + 0.8 * len(rows)))
  im = ax.imshow(v, cmap="magma", aspect="auto")
  ax.set_xticks(range(len(cols)), cols)
  ax.set_yticks(range(len(rows)), rows)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  for i in range(v.shape[0]):
    for j in range(v.shape[1]):
      if np.isfinite(v[i, j]):
        ax.text(j, i, f"{v[i, j]:.3g}", ha="center", va="center", fontsize=8, color="cyan")
  fig.colorbar(im, ax=ax)
  ax.set_title(title)
  return save(fig, path)
