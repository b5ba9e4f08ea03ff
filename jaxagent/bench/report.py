"""The benchmark's results as markdown tables and a scaling plot, rendered from the dict
`run.run_benchmark` returns (and benchmark.json holds): nothing here measures.

`with_limits` adds the fractions of the machine's limits (MFU over the peak, the decode's
fraction of its bandwidth bound) to a result; `markdown` renders every section present; each
`*_lines` function renders one section (a list of lines, empty where the section did not run).
"""

from __future__ import annotations

from jaxagent.eval.plots import plt, save
from jaxagent.planning.flops import bandwidth_bound, utilisation
from jaxagent.planning.memory import format_bytes


def with_limits(res: dict, peak: float, bandwidth: float) -> None:
  """Adds each section's model FLOP utilisation (over `peak` FLOP/s) and its decode's bandwidth
  bound (reading its bytes at `bandwidth` bytes/s) and fraction of that bound."""
  for sec in (res, res.get("big") or {}, res.get("smollm2") or {}):
    if sec and "update" in sec:
      sec["update"]["mfu"] = utilisation(sec["update"]["model_flops_per_s"], peak)
      d = sec["decode"]
      d.update(bandwidth_bound(d["tokens"], d["seconds"], d["bound_bytes"], bandwidth))


def fmt(x, digits=1) -> str:
  """A number with thousands separators and `digits` decimals."""
  return f"{x:,.{digits}f}"


def machine_lines(res: dict) -> list[str]:
  """The machine and its measured limits (each with its runs)."""
  m = res["machine"]
  runs = lambda k: " and ".join(f"{v:.0f}" for v in m.get(k + "_runs", [m[k]]))
  return [f"Machine: {m['cpu']}, {m['devices']} ({m['backend']}), jax {m['jax']}. "
          f"Measured peak float32 matmul {m['peak_gflops']:.1f} GFLOP/s (best of the runs at the "
          f"start and the end: {runs('peak_gflops')}); read bandwidth {m['bandwidth_gbs']:.1f} "
          f"GB/s ({runs('bandwidth_gbs')}).", ""]


def rollout_lines(res: dict) -> list[str]:
  """The rollout methods' table, with the decode-only and the pieces' rows, each against jax."""
  if "rollout" not in res:
    return []
  r = res["rollout"]
  jax_s = r["jax"]["seconds"]
  lines = [f"Rollout: {res['model']} ({res['params']:,} parameters), {res['env']}, "
           f"{res['episodes']} episodes x {res['turns']} turns.", "",
           "| method | seconds | episodes/s | generated tokens/s | time vs jax |",
           "|---|---|---|---|---|"]
  for k in ("jax", "jax_xla_attention", "host", "naive"):
    if k in r:
      lines.append(f"| {k} | {r[k]['seconds']:.2f} | {fmt(r[k]['episodes_per_s'])} | "
                   f"{fmt(r[k]['generated_tokens_per_s'], 0)} | {r[k]['seconds'] / jax_s:.2f}x |")
  d = res["decode"]
  lines.append(f"| decode only (no environment) | {d['seconds']:.2f} | | "
               f"{fmt(d['tokens_per_s'], 0)} | {d['seconds'] / jax_s:.2f}x |")
  if "first_prefill_seconds" in d:
    fp = d["first_prefill_seconds"]
    lines.append(f"| first observation's prefill only | {fp:.2f} | | | {fp / jax_s:.2f}x |")
  bd = res.get("breakdown")
  if bd:
    pf, ev = bd["observation_prefill"], bd["environment"]
    lines.append(f"| observation prefill only (no decode, no environment) | {pf['seconds']:.2f} "
                 f"| | | {pf['seconds'] / jax_s:.2f}x |")
    lines.append(f"| environment steps only | {ev['seconds']:.3f} | | | "
                 f"{ev['seconds'] / jax_s:.2f}x |")
  return lines


def host_path_lines(res: dict) -> list[str]:
  """The host path against the JAX path: the rollouts (model included) and the environment
  steps alone, each with the ratio jax / host, and the slow tool with and without threads."""
  hp = res.get("host_path")
  if not hp:
    return []
  r, es, slow = res["rollout"], hp["env_steps"], hp["slow_tool"]
  jax_eps, host_eps = r["jax"]["episodes_per_s"], r["host"]["episodes_per_s"]
  return ["", f"Host path vs JAX path: `{res['env']}` and its host twin `host_lookup` on the same "
          f"tasks ({hp['episodes']} episodes x {hp['turns']} turns; host: {hp['threads']} "
          "threads).", "",
          "| measure | jax | host | host, 1 thread | jax / host |", "|---|---|---|---|---|",
          f"| rollout (model included), episodes/s | {fmt(jax_eps)} | {fmt(host_eps)} | | "
          f"{jax_eps / host_eps:.2f}x |",
          f"| environment steps only (oracle actions), turns/s | "
          f"{fmt(es['jax']['turns_per_s'], 0)} | {fmt(es['host']['turns_per_s'], 0)} | "
          f"{fmt(es['host_serial']['turns_per_s'], 0)} | "
          f"{es['jax']['turns_per_s'] / es['host']['turns_per_s']:.1f}x |",
          f"| a tool that waits {slow['sleep_ms']:g} ms per call, turns/s | | "
          f"{fmt(slow['host']['turns_per_s'], 0)} | {fmt(slow['host_serial']['turns_per_s'], 0)} "
          f"| threads: {slow['host']['turns_per_s'] / slow['host_serial']['turns_per_s']:.1f}x "
          "the serial |"]


def section_names(res: dict) -> list[tuple[str, dict]]:
  """(row prefix, section) of the built-in model, the big model and SmolLM2 where they ran."""
  big_name = f"~{res['big']['size'].upper()} " if res.get("big") else ""
  return [(name, sec) for name, sec in (("", res), (big_name, res.get("big")),
                                        ("SmolLM2-135M ", res.get("smollm2"))) if sec]


def measures_lines(res: dict) -> list[str]:
  """The measures against their targets: speedups, the rollout over its pieces, the peers'
  workload, credit's overhead, and each model's decode (bound) and update (MFU)."""
  if "rollout" not in res:
    return []
  r, d, bd = res["rollout"], res["decode"], res.get("breakdown")
  speedup = r["naive"]["seconds"] / r["jax"]["seconds"]
  lines = ["", "| measure | value | target |", "|---|---|---|",
           f"| jax rollout vs naive loop (episodes/s) | {speedup:.1f}x | >= 10x |",
           f"| jax rollout time / decode-only time | {r['jax']['seconds'] / d['seconds']:.2f} | |"]
  if bd:
    work = d["seconds"] + d.get("first_prefill_seconds", 0.0) + \
        bd["observation_prefill"]["seconds"]
    lines.append(f"| jax rollout time / (decode + both prefills) time | "
                 f"{r['jax']['seconds'] / work:.2f} | <= 1.5 |")
  if res.get("peers"):
    pe = res["peers"]
    lines.append(f"| peers' workload: jax rollout vs the transformers generate loop (episodes/s) "
                 f"| {pe['speedup']:.1f}x ({fmt(pe['jax']['episodes_per_s'])} vs "
                 f"{fmt(pe['hf']['episodes_per_s'])}) | >= 5x |")
  sp = (res.get("smollm2") or {}).get("peers")
  if sp:
    lines.append(f"| SmolLM2-135M: jax rollout vs the transformers generate loop (episodes/s) "
                 f"| {sp['speedup']:.2f}x ({fmt(sp['jax']['episodes_per_s'], 2)} vs "
                 f"{fmt(sp['hf']['episodes_per_s'], 2)}) | >= 3x |")
  if res.get("credit"):
    c = res["credit"]
    lines.append(f"| update with state grouping (gigpo) vs GRPO | "
                 f"{100 * c['gigpo']['overhead']:+.1f}% ({c['gigpo']['seconds']:.3f} s vs "
                 f"{c['grpo']['seconds']:.3f} s, median of {c['repeats']} interleaved) | <= 5% |")
    if "per_turn" in c:
      lines.append(f"| update with per-turn returns (per_turn) vs GRPO | "
                   f"{100 * c['per_turn']['overhead']:+.1f}% | |")
  for name, sec in section_names(res):
    dd, u = sec["decode"], sec["update"]
    lines += [f"| {name}decode tokens/s (bound) | {fmt(dd['tokens_per_s'], 0)} "
              f"({fmt(dd['bound_tokens_per_s'], 0)}: "
              f"{100 * dd['fraction_of_bound']:.0f}% of it) | |",
              f"| {name}update tokens/s, MFU | {fmt(u['tokens_per_s'], 0)}, "
              f"{100 * u['mfu']:.1f}% of peak ({u['model_flops_per_s'] / 1e9:.1f} GFLOP/s) | "
              f"{'>= 40%' if name else ''} |"]
  return lines


def profile_lines(res: dict) -> list[str]:
  """The decode-step profiles' table (the built-in model's and the big model's), with the cache
  read's time at the measured bandwidth."""
  big = res.get("big") or {}
  profiles = [(res["model"], (res.get("breakdown") or {}).get("decode_step")),
              (f"~{big['size'].upper()} " if big else "", big.get("decode_step"))]
  if not any(p for _, p in profiles):
    return []
  lines = ["", "A decode step, split by ablation (ms per step; `cache attention` = the step "
           "minus the step with no cached slots to attend):", "",
           "| model | rows x cached slots | step (path) | step (XLA blocks) | step (XLA "
           "dense) | without cache attention | cache attention | sampling | cache read at "
           "the measured bandwidth |",
           "|---|---|---|---|---|---|---|---|---|"]
  for name, pr in profiles:
    if pr:
      bw_ms = 1e3 * pr["kv_bytes"] / (res["machine"].get("bandwidth_gbs", 0) * 1e9 or 1)
      blocks = pr.get("step_xla_blocks_ms", pr["step_ms"])
      lines.append(f"| {name} | {pr['batch']} x {pr['context']} | "
                   f"{pr['step_ms']:.2f} ({pr.get('step_path', 'xla blocks')}) | "
                   f"{blocks:.2f} | {pr['step_dense_ms']:.2f} | "
                   f"{pr['step_without_cache_attention_ms']:.2f} | "
                   f"{pr['cache_attention_ms']:.2f} | {pr['sampling_ms']:.2f} | {bw_ms:.2f} |")
  return lines


def peers_lines(res: dict) -> list[str]:
  """The peers' workload in a paragraph: the jax rollout against the transformers loop."""
  pe = res.get("peers")
  if not pe:
    return []
  line = (f"Peers' workload (../shared/peers): a {pe['params']:,}-parameter Qwen2 "
          f"(random weights, exported and loaded by transformers: logits within "
          f"{pe['logits_max_abs_diff']:.1e}), `lookup` with {pe['hops']} hops, "
          f"{pe['episodes']} episodes x {pe['turns']} turns x <= {pe['tokens_per_turn']} "
          f"tokens: jax rollout {pe['jax']['seconds']:.2f} s "
          f"({fmt(pe['jax']['episodes_per_s'])} episodes/s, transcripts of "
          f"{pe['jax']['mean_length']:.0f} tokens); the transformers generate loop "
          f"(torch, {pe['torch_threads']} threads, history re-encoded every turn) "
          f"{pe['hf']['seconds']:.2f} s ({fmt(pe['hf']['episodes_per_s'])} episodes/s).")
  if pe.get("jax_xla_attention"):
    xa = pe["jax_xla_attention"]
    line += (f" The jax rollout with XLA's cache attention instead of the kernel: "
             f"{xa['seconds']:.2f} s ({fmt(xa['episodes_per_s'])} episodes/s, "
             f"{pe['hf']['seconds'] / xa['seconds']:.1f}x the transformers loop).")
  return ["", line]


def models_lines(res: dict) -> list[str]:
  """A line each for the big model and SmolLM2: sizes, batch, and (SmolLM2) its rollout."""
  lines = []
  if res.get("big"):
    b = res["big"]
    lines += ["", f"~{b['size'].upper()} model: {b['params']:,} parameters ({b['dtype']}), "
              f"random weights, {b['episodes']} "
              f"episodes x {b['turns']} turns (decode {b['decode']['tokens']} tokens; update "
              f"{b['update']['tokens']} tokens padded to {b['update']['padded_length']})."]
  if res.get("smollm2"):
    sm = res["smollm2"]
    r = sm["rollout"]
    lines += ["", f"SmolLM2-135M model: {sm['params']:,} parameters ({sm['dtype']}), the real "
              f"weights (Q4_1 dequantised), its own tokenizer, {sm['episodes']} episodes x "
              f"{sm['turns']} turns: jax rollout {r['seconds']:.2f} s, "
              f"{fmt(r['episodes_per_s'], 2)} episodes/s, "
              f"{fmt(r['generated_tokens_per_s'], 0)} generated tokens/s (mean transcript "
              f"{r['mean_length']:.0f} tokens); decode {sm['decode']['tokens']} tokens; update "
              f"{sm['update']['tokens']} tokens padded to {sm['update']['padded_length']}."]
    if sm.get("peers"):
      sp = sm["peers"]
      lines[-1] += (
          f" Against the transformers loop (the same weights: logits within "
          f"{sp['logits_max_abs_diff']:.1e}; torch on {sp['torch_threads']} threads, history "
          f"re-encoded every turn), {sp['episodes']} episodes x {sp['turns']} turns x <= "
          f"{sp['tokens_per_turn']} tokens, median of {len(sp['rounds'])} interleaved rounds: "
          f"jax rollout {sp['jax']['seconds']:.2f} s, transformers loop "
          f"{sp['hf']['seconds']:.2f} s ({sp['speedup']:.2f}x).")
  return lines


def scaling_lines(res: dict) -> list[str]:
  """The scaling sweep's table (one row per point)."""
  if not res.get("scaling"):
    return []
  lines = ["", "Scaling of the jitted rollout (one axis at a time; scaling.png):", "",
           "| axis | episodes | turns | tokens/turn | mean length | seconds | episodes/s | "
           "generated tokens/s |", "|---|---|---|---|---|---|---|---|"]
  for s in res["scaling"]:
    lines.append(f"| {s['axis']} | {s['episodes']} | {s['turns']} | {s['tokens_per_turn']} | "
                 f"{s['mean_length']:.0f} | {s['seconds']:.2f} | {fmt(s['episodes_per_s'])} | "
                 f"{fmt(s['generated_tokens_per_s'], 0)} |")
  return lines


def nbytes(n) -> str:
  """Bytes in the planner's units, or "n/a" for None (a backend that reports no memory)."""
  return "n/a" if n is None else format_bytes(n)


def accelerator_lines(res: dict) -> list[str]:
  """The accelerator section: the device, its limits and versions; each model's rollout at each
  batch; each model's decode (bound), update (MFU), transformers loop and memory at the detail
  batch."""
  ac = res.get("accelerator")
  if not ac:
    return []
  lim, v = ac["limits"], ac["versions"]
  vers = ", ".join(f"{k} {x}" for k, x in v.items() if x)
  lines = ["", f"Accelerator preset ({ac['date']}): {lim['device']} ({ac['backend']}); {vers}. "
           f"HBM bandwidth {lim['bandwidth'] / 1e12:.3f} TB/s ({lim['bandwidth_source']}), "
           f"dense bf16 peak {lim['peak_bf16_flops'] / 1e12:.1f} TFLOP/s "
           f"({lim['peak_source']}). Random weights in {ac['dtype']} on the built-in "
           f"tokenizer's vocabulary, `lookup`, {ac['turns']} turns per episode.", "",
           "| model | parameters | episodes | seconds | episodes/s | generated tokens/s |",
           "|---|---|---|---|---|---|"]
  ran = [m for m in ac["models"] if "skipped" not in m]
  for m in ac["models"]:
    if "skipped" in m:
      params = "" if m["params"] is None else f"{m['params']:,}"
      lines.append(f"| {m['shape']} | {params} | skipped: {m['skipped']} | | | |")
    for r in m.get("batches", ()):
      lines.append(f"| {m['shape']} | {m['params']:,} | {r['episodes']} | {r['seconds']:.2f} | "
                   f"{fmt(r['episodes_per_s'])} | {fmt(r['generated_tokens_per_s'], 0)} |")
  lines += ["", f"At {ac['detail_batch']} episodes (peak memory: the process's high-water mark "
            "after the model's rows; planned: the planner's bytes for them; the device holds "
            f"{nbytes(lim.get('device_bytes'))}):", "",
            "| model | decode tokens/s (bound: share) | update tokens/s, MFU | transformers "
            "loop episodes/s (device) | jax rollout vs transformers | peak memory / planned |",
            "|---|---|---|---|---|---|"]
  for m in ran:
    d, u, hf = m["decode"], m["update"], m.get("hf")
    hf_cell = (f"{fmt(hf['episodes_per_s'], 2)} ({hf['device']})" if hf else
               f"not run ({m.get('hf_skipped', 'off')})")
    ratio = f"{m['hf_ratio']:.2f}x" if hf else "n/a"
    lines.append(f"| {m['shape']} | {fmt(d['tokens_per_s'], 0)} "
                 f"({fmt(d['bound_tokens_per_s'], 0)}: {100 * d['fraction_of_bound']:.1f}%) | "
                 f"{fmt(u['tokens_per_s'], 0)}, {100 * u['mfu']:.2f}% | {hf_cell} | {ratio} | "
                 f"{nbytes(m['peak_bytes'])} / {nbytes(m['planned_bytes'])} |")
  return lines


def markdown(res: dict) -> str:
  """Every section of `res` present, in the order of benchmark.md (call `with_limits` first)."""
  lines = (machine_lines(res) + rollout_lines(res) + measures_lines(res) + host_path_lines(res)
           + profile_lines(res) + peers_lines(res) + models_lines(res) + scaling_lines(res)
           + accelerator_lines(res))
  return "\n".join(lines) + "\n"


def scaling_plot(rows: list[dict], path) -> str:
  """scaling.png: episodes/s and generated tokens/s against each axis of the sweep."""
  axes_spec = (("batch", "episodes", "episodes per batch"), ("turns", "turns", "turns per episode"),
               ("tokens per turn", "mean_length", "mean transcript length (tokens)"))
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
  for ax, (axis, key, label) in zip(axes, axes_spec):
    pts = [r for r in rows if r["axis"] == axis]
    x = [r[key] for r in pts]
    ax.plot(x, [r["episodes_per_s"] for r in pts], "o-", label="episodes/s")
    ax2 = ax.twinx()
    ax2.plot(x, [r["generated_tokens_per_s"] for r in pts], "s--", color="tab:orange",
             label="generated tokens/s")
    ax.set_xlabel(label)
    ax.set_ylabel("episodes/s")
    ax2.set_ylabel("generated tokens/s", color="tab:orange")
    if axis == "batch":
      ax.set_xscale("log", base=2)
    ax.set_title(f"jitted rollout vs {axis}")
  fig.tight_layout()
  return save(fig, path)
