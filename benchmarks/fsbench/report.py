"""Output: the JSON of every figure, the Markdown table, the PNG plots, RESULTS.md.

The headline columns are ratios: a peer's time (or memory) over torch FSDP2's and
over plain local training's, so that they read the same on any machine.
"""

from __future__ import annotations

import json
import os
import shutil

from fsbench.memory import bound_bytes
from fsbench.peers import LABELS, PEERS

MIB = 2**20
PLOTS = ("step_time.png", "memory.png", "memory_timeline.png", "collectives.png")


# ------------------------------------------------------------------ helpers
KEPT_MARKER = "<!-- Kept across runs: everything below is written by hand. -->"


def _ok(entry: dict | None) -> bool:
    return bool(entry) and entry.get("status") == "ok"


def _median(run: dict | None, peer: str) -> float | None:
    entry = (run or {}).get("peers", {}).get(peer)
    return entry["time"]["median_ms"] if _ok(entry) and "time" in entry else None


def _peak(run: dict | None, peer: str) -> float | None:
    entry = (run or {}).get("peers", {}).get(peer)
    return entry["peak_bytes"] if _ok(entry) and "peak_bytes" in entry else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a is not None and b else "–"


def _ms(v: float) -> str:
    return f"{v:.3f}" if v < 1 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def _why(entry: dict | None) -> str:
    if not entry:
        return "not run"
    text = entry.get("error") or entry.get("skipped") or entry.get("status", "?")
    return text.replace("|", "\\|").replace("\n", " ")


def _timing_runs(results: dict) -> list[tuple[int, dict]]:
    """(W, {workload: result}) for the timing world sizes that ran, largest first."""
    return sorted(((int(w), runs) for w, runs in results.get("timing", {}).items()), reverse=True)


# ------------------------------------------------------------------ headline
def headline(results: dict) -> list[tuple[str, str]]:
    """The acceptance figures: (what, value)."""
    rows: list[tuple[str, str]] = []
    timing = results.get("timing", {})
    multi = [w for w, _ in _timing_runs(results) if w > 1]
    if multi:
        w = multi[0]
        for workload in ("gpt", "gpt-bf16"):
            gpt = timing[str(w)].get(workload)
            if gpt is None:
                continue
            fs = _median(gpt, "flatshard")
            for peer in ("fsdp2", "fsdp1", "ddp"):
                rows.append((f"`{workload}` W={w}: flatshard step time / {LABELS[peer]}",
                             _ratio(fs, _median(gpt, peer)) if fs and _median(gpt, peer) else _failed(gpt, peer)))
            fs2 = _median(gpt, "flatshard-fs")
            for peer in ("fsdp2", "flatshard"):
                rows.append((f"`{workload}` W={w}: {LABELS['flatshard-fs']} step time / {LABELS[peer]}",
                             _ratio(fs2, _median(gpt, peer)) if fs2 and _median(gpt, peer) else _failed(gpt, peer)))
                fb, other = (gpt["peers"].get(p, {}).get("forward_backward_ms") for p in ("flatshard-fs", peer))
                if fb and other:  # (see [Note: The forward and backward alone])
                    rows.append((f"`{workload}` W={w}: {LABELS['flatshard-fs']} forward + backward / {LABELS[peer]}",
                                 _ratio(fb, other)))
    elif any("gpt" in runs for runs in timing.values()):
        rows.append(("`gpt` W≥2 step-time ratios", "not run here (one device)"))
    if "1" in timing:
        gpt1 = timing["1"].get("gpt")
        fs, local = _median(gpt1, "flatshard"), _median(gpt1, "local")
        rows.append(("`gpt` W=1: flatshard step time / plain local training",
                     _ratio(fs, local) if fs and local else _failed(gpt1, "flatshard")))
        fs2, f2 = _median(gpt1, "flatshard-fs"), _median(gpt1, "fsdp2")
        rows.append((f"`gpt` W=1: {LABELS['flatshard-fs']} step time / {LABELS['fsdp2']}",
                     _ratio(fs2, f2) if fs2 and f2 else _failed(gpt1, "flatshard-fs")))
    for w, runs in _timing_runs(results):
        msu = runs.get("many-small-units") or {}
        for peer in ("flatshard", "flatshard-fs", "fsdp2"):
            entry = msu.get("peers", {}).get(peer)
            value = (f"{entry['overhead_us_per_unit']:.0f} µs" if _ok(entry) and "overhead_us_per_unit" in entry
                     else _failed(msu, peer))
            rows.append((f"`many-small-units` W={w}: overhead per unit per step, {LABELS[peer]}", value))
            if _ok(entry) and "forward_backward_overhead_us_per_unit" in entry:  # ([Note: The forward and backward
                rows.append((f"`many-small-units` W={w}: forward + backward overhead per unit, {LABELS[peer]}",  # alone])
                             f"{entry['forward_backward_overhead_us_per_unit']:.0f} µs"))
        ours, theirs = (msu.get("peers", {}).get(p) for p in ("flatshard-fs", "fsdp2"))
        if _ok(ours) and _ok(theirs) and "overhead_us_per_unit" in ours and "overhead_us_per_unit" in theirs:
            rows.append((f"`many-small-units` W={w}: overhead per unit, {LABELS['flatshard-fs']} / {LABELS['fsdp2']}",
                         _ratio(ours["overhead_us_per_unit"], theirs["overhead_us_per_unit"])))
        floor = msu.get("exchange_floor_us_per_unit")  # see [Note: The collectives' floor per unit] in workloads.py
        if floor is not None:
            rows.append((f"`many-small-units` W={w}: a unit's collectives alone (raw gloo, timed in the same rounds)",
                         f"{floor:.0f} µs"))
            if _ok(ours) and _ok(theirs) and "overhead_us_per_unit" in ours and "overhead_us_per_unit" in theirs:
                mine, theirs_above = (entry["overhead_us_per_unit"] - floor for entry in (ours, theirs))
                rows.append((f"`many-small-units` W={w}: overhead per unit above the collectives alone, "
                             f"{LABELS['flatshard-fs']} / {LABELS['fsdp2']}",
                             f"{max(mine, 0):.0f} µs / {theirs_above:.0f} µs"
                             + (f" = {_ratio(max(mine, 0), theirs_above)}" if theirs_above > 0 else "")
                             + (f" ({-mine:.0f} µs under the collectives alone: fewer collectives, small units "
                                f"gathered and reduced together)" if mine < 0 else "")))
    for name in ("gpt-large", "gpt-large-bf16"):
        large = timing.get("1", {}).get(name)
        if large is None:
            continue
        fs = _median(large, "flatshard")
        for peer in ("local", "fsdp2", "fsdp1"):
            rows.append((f"`{name}` W=1: flatshard step time / {LABELS[peer]}",
                         _ratio(fs, _median(large, peer)) if fs and _median(large, peer) else _failed(large, peer)))
        for peer in ("local", "fsdp2"):
            rows.append((f"`{name}` W=1: flatshard peak memory / {LABELS[peer]}",
                         _ratio(_peak(large, "flatshard"), _peak(large, peer))))
    for key, what in (("memory", "`gpt`"), ("memory_bf16", "`gpt-bf16`")):
        ws, mem = memory_rows(results, key)
        for w in ws:
            peers = mem[w].get("peers", {})
            f2 = peers.get("fsdp2")
            for peer in ("flatshard", "flatshard-fs"):
                fs = peers.get(peer)
                value = (_ratio(fs["peak_bytes"], f2["peak_bytes"]) if _ok(fs) and _ok(f2)
                         else _why(mem[w] if not peers else fs if not _ok(fs) else f2))
                rows.append((f"{what} W={w}: {LABELS[peer]} peak memory per rank / {LABELS['fsdp2']}", value))
    return rows


def _failed(run: dict | None, peer: str) -> str:
    if not run or "error" in run and "peers" not in run:
        return f"not run: {_why(run)}"
    return f"{_why(run.get('peers', {}).get(peer))}"


# ------------------------------------------------------------------ tables
def training_table(run: dict) -> list[str]:
    w = run["world_size"]
    per_unit = run["workload"] == "many-small-units"
    memory = any("peak_bytes" in e for e in run["peers"].values())
    lines = [
        f"| peer | median ms | IQR ms | min–max ms | {'samples/s' if per_unit else 'tokens/s'} "
        + ("| µs per unit over local " if per_unit else "") + "| × FSDP2 | × local | guard |"
        + ("| peak MiB (state) | peak × FSDP2 | peak × local |" if memory else ""),
        "| --- | ---: | ---: | ---: | ---: |" + (" ---: |" if per_unit else "") + " ---: | ---: | --- |"
        + (" ---: | ---: | ---: |" if memory else ""),
    ]
    fsdp2, local = _median(run, "fsdp2"), _median(run, "local")
    for peer in PEERS:
        entry = run["peers"].get(peer)
        if not _ok(entry):
            lines.append(f"| {LABELS[peer]} | {entry.get('status', '?') if entry else 'not run'} | | | |"
                         + (" |" if per_unit else "") + f" | | {_why(entry)} |")
            continue
        t = entry["time"]
        guard = entry.get("guard", {})
        if guard.get("baseline"):
            verdict = "baseline" if w > 1 else "reference"
        else:
            verdict = f"pass (loss {guard.get('loss_rel_err', 0):.0e}, grad {guard.get('grad_norm_rel_err', 0):.0e})"
        if "guard_as_built" in entry:
            verdict += "; as built: fail, timed with SUM+divide"
        overhead = ""
        if per_unit:
            overhead = f"| {entry['overhead_us_per_unit']:.0f} " if peer != "local" else "| – "
        lines.append(
            f"| {LABELS[peer]} | {_ms(t['median_ms'])} | {_ms(t['iqr_ms'])} | {_ms(t['min_ms'])}–{_ms(t['max_ms'])} "
            f"| {entry['tokens_per_s']:,.0f} {overhead}| {_ratio(t['median_ms'], fsdp2)} "
            f"| {_ratio(t['median_ms'], local)} | {verdict} |"
            + (f" {entry['peak_bytes'] / MIB:,.0f} ({entry['state_bytes'] / MIB:,.0f}) "
               f"| {_ratio(entry['peak_bytes'], _peak(run, 'fsdp2'))} | {_ratio(entry['peak_bytes'], _peak(run, 'local'))} |"
               if memory and "peak_bytes" in entry else (" | | |" if memory else ""))
        )
    return lines


def limiter_table(lim: dict) -> list[str]:
    if "rows" not in lim:
        return [f"Not run: {_why(lim)}"]
    lines = ["| all-gathers in flight | median step ms | peak allocated MiB | peak reserved MiB | limiter stalls | "
             "allocator retries |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in lim["rows"]:
        lines.append(f"| {r['limit'] or 'unbounded'} | {_ms(r['median_ms'])} | {r['peak_bytes'] / MIB:,.0f} "
                     f"| {r['peak_reserved_bytes'] / MIB:,.0f} | {r['limiter_stalls']} | {r['num_alloc_retries']} |")
    return lines


def collectives_table(coll: dict) -> list[str]:
    if "sizes" not in coll:
        return [f"Not run: {_why(coll)}"]
    ops = ("flatshard all_gather", "raw all_gather_into_tensor", "flatshard reduce_scatter", "raw reduce_scatter_tensor")
    lines = [
        "| unit MB | flatshard all-gather ms | raw all_gather_into_tensor ms | ratio | flatshard reduce-scatter ms "
        "| raw reduce_scatter_tensor ms | ratio | raw all-gather GB/s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in coll["sizes"]:
        got = row.get("ops", {})
        med = {op: got[op]["median_ms"] if "median_ms" in got.get(op, {}) else None for op in ops}
        cells = [_ms(med[op]) if med[op] is not None else _why(got.get(op) or row) for op in ops]
        gbps = got.get(ops[1], {}).get("gb_per_s")
        lines.append(f"| {row['size_mb']} | {cells[0]} | {cells[1]} | {_ratio(med[ops[0]], med[ops[1]])} | {cells[2]} "
                     f"| {cells[3]} | {_ratio(med[ops[2]], med[ops[3]])} | {gbps:.2f} |" if gbps else
                     f"| {row['size_mb']} | {cells[0]} | {cells[1]} | – | {cells[2]} | {cells[3]} | – | – |")
    return lines


def memory_rows(results: dict, key: str = "memory") -> tuple[list[int], dict]:
    mem = {int(w): r for w, r in results.get(key, {}).items()}
    return sorted(mem), mem


def memory_table(results: dict, key: str = "memory") -> list[str]:
    ws, mem = memory_rows(results, key)
    if not ws:
        return ["Not run."]
    head = " | ".join(f"W={w}" for w in ws)
    lines = [
        f"| peer | {head} | {' | '.join(f'× FSDP2, W={w}' for w in ws)} | {' | '.join(f'× local, W={w}' for w in ws)} |",
        "| --- |" + " ---: |" * (3 * len(ws)),
    ]

    def peak(w: int, peer: str) -> float | None:
        entry = mem[w].get("peers", {}).get(peer)
        return entry["peak_bytes"] / MIB if _ok(entry) else None

    for peer in PEERS:
        cells = []
        for w in ws:
            p = peak(w, peer)
            entry = mem[w].get("peers", {}).get(peer) if "peers" in mem[w] else mem[w]
            state = f" ({entry['state_bytes'] / MIB:.1f})" if _ok(entry) else ""
            cells.append(f"{p:.1f}{state}" if p is not None else _why(entry))
        cells += [_ratio(peak(w, peer), peak(w, "fsdp2")) for w in ws]
        cells += [_ratio(peak(w, peer), peak(w, "local")) for w in ws]
        lines.append(f"| {LABELS[peer]} | " + " | ".join(cells) + " |")
    bounds = []
    for w in ws:
        r = mem[w]
        if "param_bytes" in r:
            b = bound_bytes(r["param_bytes"], r["root_unit_param_bytes"], r["block_unit_param_bytes"], w)
            bounds.append(f"{b['total'] / MIB:.1f}")
        else:
            bounds.append("–")
    lines.append("| bound: (P+G+O)/W + in flight | " + " | ".join(bounds) + " |" + " |" * (2 * len(ws)))
    counters = []
    for w in ws:
        entry = mem[w].get("peers", {}).get("flatshard")
        counters.append(f"{entry['flatshard_peak_unsharded_bytes'] / MIB:.2f}" if _ok(entry) else "–")
    lines.append("| flatshard's own counter: peak unsharded bytes | " + " | ".join(counters) + " |"
                 + " |" * (2 * len(ws)))
    return lines


def activation_bytes(results: dict) -> float | None:
    """Local run's peak minus its params, grads and AdamW state: activations and temporaries."""
    for r in results.get("memory", {}).values():
        entry = r.get("peers", {}).get("local")
        if _ok(entry):
            return entry["peak_bytes"] - 4 * r["param_bytes"]
    return None


def markdown(results: dict) -> str:
    meta = results["meta"]
    out = [
        f"Date: {meta['date']} · commit `{meta['commit']}` · {meta['machine']} · torch {meta['torch']}",
        "",
        f"Command: `{meta['command']}` · wall time {results.get('wall_s', 0):.0f} s"
        + (" · **quick smoke run, not for comparison**" if meta.get("quick") else ""),
        "",
        "### Headline",
        "",
        "| what | value |",
        "| --- | ---: |",
    ]
    out += [f"| {k} | {v} |" for k, v in headline(results)]
    for w, runs in _timing_runs(results):
        for workload, run in runs.items():
            out += ["", f"### `{workload}`, W={w}"]
            if "peers" not in run:
                out += ["", f"Not run: {_why(run)}"]
                continue
            plan = run["plan"]
            kept = plan["rounds"] * (plan["steps_per_block"] - plan["drop_per_block"])
            out += ["", f"{run['backend']} on {run['device']}, global batch {run['global_batch']}"
                    + (f" × {run['tokens_per_step'] // run['global_batch']} tokens" if workload.startswith("gpt") else "")
                    + (", TF32 matrix products" if run.get("tf32") else "")
                    + (", bf16 mixed precision (see [Note: bf16 peers])" if run.get("precision") == "bf16" else "")
                    + f", {run['units']} units, {run['param_bytes'] / MIB:.1f} MiB of parameters; {kept} timed steps "
                    f"per peer ({plan['rounds']} interleaved rounds of {plan['steps_per_block']}, first of each "
                    f"dropped, after {plan['warmup']} warm-up + 4 guard steps). Ratios are of medians.", ""]
            out += training_table(run)
            notes = [f"{LABELS[p]}: {n}" for p, e in run["peers"].items() for n in e.get("notes", [])]
            if "exchange_floor_us_per_unit" in run:  # see [Note: The collectives' floor per unit] in workloads.py
                notes.append(f"A unit's collectives alone (two all-gathers and a reduce-scatter of a unit's bytes, raw "
                             f"{run['backend']}, timed in the same rounds): {run['exchange_floor_us_per_unit']:.0f} µs "
                             f"per unit; every sharded peer's overhead per unit holds it")
            if notes:
                out += [""] + [f"- {n}" for n in notes]
    coll = results.get("collectives")
    if coll is not None:
        out += ["", f"### `collectives`, W={coll.get('world_size', '?')}", ""]
        out += ["flatshard's path (unshard + wait; accumulate_grad + reduce_grad + finish_grad_sync) against the "
                "bare collective on the same bytes (preallocated output); medians. flatshard's path also "
                "allocates its buffer and, for reduce-scatter, flattens and divides the gradient.", ""]
        out += collectives_table(coll)
    lim = results.get("limiter")
    if lim is not None:
        out += ["", f"### `limiter`, W={lim.get('world_size', 2)} on one GPU (gloo)", "",
                "flatshard alone, a 110 M-parameter GPT, FULL_SHARD with forward and backward prefetch; median of "
                f"{lim.get('steps', '?')} steps per setting after 2 warm-up steps; max over ranks.", ""]
        out += limiter_table(lim)
    mem = results.get("memory")
    if mem:
        act = activation_bytes(results)
        methods = sorted({r["method"] for r in mem.values() if "method" in r})
        out += ["", "### Peak memory per rank", "",
                "Peak (state between steps) in MiB, `gpt` with one 16-token sequence per rank, measured the same "
                f"way for every peer ({'; '.join(methods) or '–'}; see `benchmarks/README.md`). "
                "Peak includes activations and temporaries"
                + (f" (local run: {act / MIB:.2f} MiB)" if act is not None else "")
                + "; the bound is (params + grads + AdamW state) / W plus the root and two blocks unsharded and one "
                "block's unsharded gradient. Every peer as built (FSDP2 with its default reduce op).", ""]
        out += memory_table(results)
    if results.get("memory_bf16"):
        out += ["", "### Peak memory per rank, bf16 mixed precision", "",
                "As above, every peer in bf16 mixed precision (see [Note: bf16 peers] in `fsbench/peers.py`); the "
                "fp32 bound does not apply.", ""]
        out += [line for line in memory_table(results, "memory_bf16") if not line.startswith("| bound")]
    problems = _problems(results)
    if problems:
        out += ["", "### Could not run / failed", ""] + [f"- {p}" for p in problems]
    return "\n".join(out) + "\n"


def _problems(results: dict) -> list[str]:
    found = []
    for w, runs in _timing_runs(results):
        for workload, run in runs.items():
            if "peers" not in run:
                found.append(f"`{workload}` W={w}: {_why(run)}")
                continue
            for peer, entry in run["peers"].items():
                if not _ok(entry):
                    found.append(f"`{workload}` W={w}, {LABELS.get(peer, peer)}: {_why(entry)}")
                if "guard_as_built" in entry:
                    found.append(f"`{workload}` W={w}, {LABELS[peer]} as built failed the guard "
                                 f"({_why(entry['guard_as_built'])}); timed with SUM + divide")
    coll = results.get("collectives")
    if coll and "sizes" not in coll:
        found.append(f"`collectives`: {_why(coll)}")
    for row in (coll or {}).get("sizes", []):
        if "error" in row:
            found.append(f"`collectives` {row['size_mb']} MB: {_why(row)}")
    for key, what in (("memory", "memory"), ("memory_bf16", "memory bf16")):
        for w, r in sorted(results.get(key, {}).items()):
            if "peers" not in r:
                found.append(f"{what} W={w}: {_why(r)}")
                continue
            for peer, entry in r["peers"].items():
                if not _ok(entry):
                    found.append(f"{what} W={w}, {LABELS.get(peer, peer)}: {_why(entry)}")
    return found


# ------------------------------------------------------------------ plots
def plots(results: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 8, "axes.titlesize": 9})
    written = []
    for name, draw in (("step_time.png", _plot_steps), ("memory.png", _plot_memory),
                       ("memory_timeline.png", _plot_timeline), ("collectives.png", _plot_collectives)):
        fig = draw(plt, results)
        if fig is None:
            continue
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written


def _plot_steps(plt, results: dict):
    panels = [(w, wl, run) for w, runs in _timing_runs(results) for wl, run in runs.items() if "peers" in run]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.0), squeeze=False)
    for ax, (w, wl, run) in zip(axes[0], panels):
        names = [p for p in PEERS if _ok(run["peers"].get(p))]
        ax.boxplot([run["peers"][p]["samples_ms"] for p in names], showfliers=False, widths=0.6)
        ax.set_xticks(range(1, len(names) + 1), [LABELS[p].replace("torch ", "").replace(" (no comm)", "")
                                                 for p in names], rotation=30)
        ax.set_title(f"{wl}, W={w}")
        ax.set_ylabel("step time, ms")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def _plot_memory(plt, results: dict):
    ws, mem = memory_rows(results)
    ws = [w for w in ws if "peers" in mem[w]]
    if not ws:
        return None
    fig, ax = plt.subplots(figsize=(4.8, 3.2))
    for peer in PEERS:
        pts = [(w, mem[w]["peers"][peer]["peak_bytes"] / MIB) for w in ws if _ok(mem[w]["peers"].get(peer))]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=LABELS[peer])
    bound = [bound_bytes(mem[w]["param_bytes"], mem[w]["root_unit_param_bytes"], mem[w]["block_unit_param_bytes"],
                         w)["total"] / MIB for w in ws]
    ax.plot(ws, bound, "k--", label="bound (P+G+O)/W + in flight")
    act = activation_bytes(results)
    if act is not None:
        ax.plot(ws, [b + act / MIB for b in bound], "k:", label="bound + local activations")
    ax.set_xticks(ws)
    ax.set_xlabel("world size W")
    ax.set_ylabel("peak MiB per rank")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def _plot_timeline(plt, results: dict):
    ws, mem = memory_rows(results)
    w = max((w for w in ws if "peers" in mem[w]), default=None)
    if w is None:
        return None
    fig, ax = plt.subplots(figsize=(5.6, 2.8))
    drawn = False
    for peer in ("flatshard", "fsdp2"):
        entry = mem[w]["peers"].get(peer, {})
        tl = entry.get("timeline_rank0")
        if not tl:
            continue
        ax.step(_step_fractions(tl), [b / MIB for b in tl["bytes"]], where="post", label=LABELS[peer], lw=0.8)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    for i in range(1, len(tl["step_starts_ms"])):
        ax.axvline(i, color="grey", lw=0.5)
    ax.set_xlabel("measured step (each step's duration scaled to 1)")
    ax.set_ylabel("live MiB, rank 0")
    ax.set_title(f"memory during training steps, gpt, W={w}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _step_fractions(tl: dict) -> list[float]:
    """Event times as step index + fraction of that step, so peers' steps line up."""
    spans = list(zip(tl["step_starts_ms"], tl["step_ends_ms"]))
    out, i = [], 0
    for t in tl["ms"]:
        while i + 1 < len(spans) and t >= spans[i + 1][0]:
            i += 1
        s, e = spans[i]
        out.append(i + min(max((t - s) / (e - s), 0.0), 1.0))
    return out


def _plot_collectives(plt, results: dict):
    coll = results.get("collectives") or {}
    rows = [r for r in coll.get("sizes", []) if "ops" in r]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(4.8, 3.2))
    styles = {"flatshard all_gather": "C0-o", "raw all_gather_into_tensor": "C0--s",
              "flatshard reduce_scatter": "C1-o", "raw reduce_scatter_tensor": "C1--s"}
    for op, style in styles.items():
        pts = [(r["size_mb"], r["ops"][op]["median_ms"]) for r in rows if "median_ms" in r["ops"].get(op, {})]
        if pts:
            ax.plot(*zip(*pts), style, label=op, ms=3)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("unit size, MB")
    ax.set_ylabel("median ms")
    ax.set_title(f"collectives, W={coll.get('world_size')}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------ writing
def write(results: dict, out_dir: str, publish_dir: str | None) -> dict:
    """Writes results.json, table.md and the plots to ``out_dir``; with ``publish_dir`` (the
    benchmarks folder) also RESULTS.md and copies of the table and plots in ``results/``."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "results.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    table = markdown(results)
    table_path = os.path.join(out_dir, "table.md")
    with open(table_path, "w") as f:
        f.write(table)
    pngs = plots(results, out_dir)
    written = {"json": json_path, "table": table_path, "plots": pngs}
    if publish_dir:
        res_dir = os.path.join(publish_dir, "results")
        os.makedirs(res_dir, exist_ok=True)
        shutil.copy(table_path, os.path.join(res_dir, "table.md"))
        for p in pngs:
            shutil.copy(p, os.path.join(res_dir, os.path.basename(p)))
        names = [os.path.basename(p) for p in pngs]
        doc = ["# Benchmark results", "",
               "Latest run of `python benchmarks/run.py` (see `benchmarks/README.md` for the method). "
               "The table is also in `results/table.md`; every figure is in `out/results.json` of the run.", "",
               table, "## Plots", ""]
        captions = {
            "step_time.png": "Step time per peer (box: quartiles, whiskers: range without outliers)",
            "memory.png": "Peak memory per rank against world size, with the analytic bound",
            "memory_timeline.png": "Live memory during the measured steps, flatshard and FSDP2",
            "collectives.png": "flatshard's all-gather / reduce-scatter path against the raw collectives",
        }
        doc += [f"![{captions[n]}](results/{n})" + "\n" for n in names]
        path = os.path.join(publish_dir, "RESULTS.md")
        kept = ""
        if os.path.exists(path):
            with open(path) as f:
                kept = kept_sections(f.read())
        with open(path, "w") as f:
            f.write("\n".join(doc))
            if kept:
                f.write("\n" + kept)
        written["results_md"] = path
    return written


def kept_sections(old: str) -> str:
    """What of the old RESULTS.md a run keeps: everything below the marker (GPU runs, analysis, written by hand), and
    any hand-written ``## `` section found above it (this run's part has none but "## Plots"), moved to just below
    the marker, so that a section added in the wrong place is never lost."""
    if KEPT_MARKER not in old:
        return ""
    above, below = old[:old.index(KEPT_MARKER)], old[old.index(KEPT_MARKER) + len(KEPT_MARKER):]
    sections, current = [], None
    for line in above.splitlines(keepends=True):
        if line.startswith("## "):
            current = [] if line.startswith("## Plots") else [line]
            if current:
                sections.append(current)
        elif current:
            current.append(line)
    hand = "".join("".join(s) for s in sections)
    return KEPT_MARKER + ("\n" + hand.rstrip("\n") + "\n" if hand else "") + below
