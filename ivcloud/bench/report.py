"""Plots and a markdown report from the cloud benchmarks' JSON.

It reads DIR/hierarchy.json, DIR/halo.json and DIR/apps.json, whichever
exist (each cloud benchmark writes its own and redoes the report), and
writes into DIR the plots and report.md of docs/demo.md, "Outputs".
Nothing is measured: `ivcloud bench report DIR` redoes it from the JSON
alone and prints the path of report.md.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import ReportError
from .toolkit import (busy_reasons, busy_warning, find_record, fmt_size,
                      spread_note, write_docs)

# one colour per level, one line style per transport: the level is what
# the figures are about, the transport what changes within a level
LEVEL_COLOURS = {1: "#2ca02c", 2: "#1f77b4", 3: "#d62728"}
TRANSPORT_STYLES = {"ivshmem": ("-", "o"), "tcp": ("--", "s")}
PLACEMENT_COLOURS = {"round-robin": "#d62728", "planned": "#2ca02c"}


def _load(path: Path) -> Optional[Dict]:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReportError(f"cannot read {path}: {e}")


# ---------------------------------------------------------------- tables
# The tables of the cloud benchmarks, from their records alone: the
# benchmarks print them, the markdown below embeds them.

def hierarchy_columns(records: Sequence[Dict],
                      transports: Sequence[str]) -> List[Tuple[int, str]]:
    """(level, transport) pairs that have records: levels in order, each
    level's transports in the order given."""
    have = {(r["level"], r["transport"]) for r in records}
    return [(lv, t) for lv in sorted({lv for lv, _ in have})
            for t in transports if (lv, t) in have]


def hierarchy_table(records: Sequence[Dict], test: str,
                    transports: Sequence[str]) -> Tuple[List[str],
                                                        List[List[str]]]:
    """(header, rows) of one test: a row per size, a column per (level,
    transport); latency in us, bandwidth in MB/s; last, the BTL row."""
    cols = hierarchy_columns(records, transports)
    key, fmt = (("latency_us", "{:.2f}") if test == "latency"
                else ("bandwidth_MBps", "{:.1f}"))
    header = ["size"] + [f"L{lv} {t}" for lv, t in cols]
    sizes = sorted({r["size"] for r in records if r["test"] == test})
    rows = []
    for size in sizes:
        row = [fmt_size(size)]
        for lv, t in cols:
            r = find_record(records, level=lv, transport=t, test=test,
                            size=size)
            row.append(fmt.format(r[key]) if r else "-")
        rows.append(row)
    rows.append(["BTL used"] + [find_record(records, level=lv,
                                            transport=t)["btl"]
                                for lv, t in cols])
    return header, rows


def halo_table(summ: Dict[str, Dict]) -> Tuple[List[str], List[List[str]]]:
    """(header, rows): a row per placement of `ivcloud bench halo`."""
    header = ["placement", "wall s (median)", "runs", "per iteration us",
              "edges across servers", "across instances",
              "inside instances"]
    rows = []
    for name, s in summ.items():
        c = s["cut"]
        rows.append([name, f"{s['wall_s']:.3f}",
                     " ".join(f"{w:.3f}" for w in s["runs"]),
                     f"{s['per_iter_us']:.0f}",
                     f"{c['across_servers']:g}",
                     f"{c['across_instances']:g}",
                     f"{c['inside_instances']:g}"])
    return header, rows



def apps_table(doc: Dict) -> Tuple[List[str], List[List[str]]]:
    """(header, rows) of `ivcloud bench apps`: a row per application
    figure, its medians (spread) per configuration and the speeds."""
    summ = {(r["app"], r["config"], r["metric"]): r
            for r in doc["records"] if r["ranks"] == 2}
    configs = [("one", "one"), ("one, 2 copies", "one-twocopy"),
               ("tcp", "tcp"), ("ivshmem", "ivshmem")]
    ratios = [("tcp/one", "tcp_vs_one"), ("ivshmem/one", "ivshmem_vs_one"),
              ("ivshmem/one, 2 copies", "ivshmem_vs_one_twocopy"),
              ("ivshmem/tcp", "ivshmem_vs_tcp")]
    # only the configurations that ran (one-twocopy is HPCC's, and
    # --configs may leave out tcp or ivshmem), and the ratios between them
    ran = {c for _, c, _ in summ}
    configs = [(h, c) for h, c in configs if c in ran]
    ratios = [(h, key) for h, key in ratios
              if any(r.get(key) is not None for r in doc["relative"])]
    header = ["application", "figure"] + [h for h, _ in configs + ratios]
    rows = []
    for rel in doc["relative"]:
        app, metric = rel["app"], rel["metric"]
        meta = doc["metrics"][f"{app}:{metric}"]
        cells = [app, f"{meta['label']} ({meta['unit']})"]
        for _, config in configs:
            r = summ.get((app, config, metric))
            cells.append(f"{r['value']:.4g} ({r['value_min']:.3g}.."
                         f"{r['value_max']:.3g})" if r else "-")
        for _, key in ratios:
            v = rel.get(key)
            cells.append("-" if v is None else f"{v:.2f}")
        rows.append(cells)
    return header, rows


# A strong-scaling series says something only over rank counts the host
# runs without oversubscription (ranks beyond its CPUs measure the time
# slicing), and Amdahl's law fitted to fewer than 3 points, or to a
# serial fraction outside [0, 1], is a curve through noise.
MIN_FIT_POINTS = 3


def amdahl_serial_fraction(points: Sequence[Tuple[int, float]]
                           ) -> Optional[float]:
    """Least-squares f in S(p) = 1 / (f + (1 - f) / p) from (p, S): with
    y = 1/S - 1/p and x = 1 - 1/p the law is y = f x."""
    xs = [(1 - 1 / p, 1 / s - 1 / p) for p, s in points if p > 1 and s]
    den = sum(x * x for x, _ in xs)
    if not den:
        return None
    return sum(x * y for x, y in xs) / den


def scaling_view(series: Dict, cpus: int) -> Dict:
    """What may be said of a strong-scaling series measured on a host of
    `cpus` CPUs: `rows` (the rank counts up to `cpus`), `left_out` (those
    above), `table` (whether 2 rank counts remain to compare), `fit`
    (Amdahl's serial fraction, or None) and `notes` (why a rank count,
    the table or the fit is missing)."""
    rows = [r for r in series["rows"] if r["ranks"] <= cpus]
    left_out = [r["ranks"] for r in series["rows"] if r["ranks"] > cpus]
    notes = []
    if left_out:
        notes.append(f"{', '.join(map(str, left_out))} ranks left out: "
                     f"the host has {cpus} CPUs, so those runs were "
                     f"oversubscribed")
    table = len(rows) >= 2
    fit = None
    if not table:
        notes.append(f"no strong-scaling table: the host has {cpus} "
                     f"CPU(s), too few to run 2 rank counts without "
                     f"oversubscription")
    elif len(rows) < MIN_FIT_POINTS:
        notes.append(f"no Amdahl fit: {len(rows)} rank counts (at least "
                     f"{MIN_FIT_POINTS} are needed)")
    else:
        f = amdahl_serial_fraction([(r["ranks"], r["speedup"])
                                    for r in rows])
        if f is None:
            notes.append("no Amdahl fit: no speed-up measured")
        elif not 0 <= f <= 1:
            notes.append(f"no Amdahl fit: the least-squares serial "
                         f"fraction is {f:.3g}, outside [0, 1] (these "
                         f"speed-ups do not follow the law)")
        else:
            fit = f
    return {"rows": rows, "left_out": left_out, "table": table,
            "fit": fit, "notes": notes}


def _with_range(value: Optional[float], lo: Optional[float],
                hi: Optional[float], fmt: str = "{:.2f}") -> str:
    if value is None:
        return "-"
    text = fmt.format(value)
    if lo is not None and hi is not None and (lo, hi) != (value, value):
        text += f" ({fmt.format(lo)}..{fmt.format(hi)})"
    return text


def scaling_table(series: Dict, cpus: int
                  ) -> Tuple[List[str], List[List[str]], List[str]]:
    """(header, rows, notes): T, S, E per rank count as in the thesis,
    with the spread of the rounds, over the rank counts scaling_view
    keeps (no rows when it keeps too few); the notes say what was left
    out, and the fit or why there is none."""
    view = scaling_view(series, cpus)
    meta = series.get("label") or ("T" if series["unit"] == "s" else "R")
    header = ["ranks", f"{meta} ({series['unit']})", "S", "E"]
    rows = []
    if view["table"]:
        rows = [[str(r["ranks"]),
                 _with_range(r["value"], r.get("value_min"),
                             r.get("value_max"), "{:.4g}"),
                 _with_range(r["speedup"], r.get("speedup_min"),
                             r.get("speedup_max")),
                 _with_range(r["efficiency"], None, None)]
                for r in view["rows"]]
    notes = list(view["notes"])
    if view["fit"] is not None:
        notes.append(f"Amdahl's law fitted to {len(view['rows'])} rank "
                     f"counts: serial fraction {view['fit']:.3f}")
    return header, rows, notes


# ---------------------------------------------------------------- plots

def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ReportError("matplotlib is not installed (apt-get install "
                          "python3-matplotlib): no plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _size_axis(ax, sizes: Sequence[int]) -> None:
    from matplotlib.ticker import FixedLocator, NullLocator
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(sizes)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([fmt_size(s) for s in sorted(sizes)], rotation=45,
                       ha="right")
    ax.set_xlabel("message size")
    ax.grid(True, which="major", alpha=0.3)


def _bars(recs: Sequence[Dict], key: str, lo: Optional[str] = None,
          hi: Optional[str] = None):
    """matplotlib's yerr for min..max bars around each record's `key`
    (the median): KEY_min and KEY_max unless named; None when a record
    has no spread (one round, or a document without it)."""
    lo, hi = lo or f"{key}_min", hi or f"{key}_max"
    if not recs or any(r.get(lo) is None or r.get(hi) is None
                       or r.get(key) is None for r in recs):
        return None
    return [[max(0.0, r[key] - r[lo]) for r in recs],
            [max(0.0, r[hi] - r[key]) for r in recs]]


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _curves(doc: Dict, test: str):
    """[(label, level, transport, records)] in level order."""
    out = []
    for lv, transport in hierarchy_columns(doc["records"],
                                           doc["transports"]):
        recs = sorted((r for r in doc["records"] if r["level"] == lv
                       and r["transport"] == transport
                       and r["test"] == test), key=lambda r: r["size"])
        if not recs:
            continue
        name = next(x["name"] for x in doc["levels"] if x["level"] == lv)
        label = f"L{lv} {name}, {transport} (via {recs[0]['btl']})"
        out.append((label, lv, transport, recs))
    return out


def plot_hierarchy(plt, doc: Dict, out: Path) -> List[Path]:
    if not doc["records"]:
        return []
    written = []
    sizes = sorted({r["size"] for r in doc["records"]})
    for test, key, ylabel, name, title in (
            ("latency", "latency_us", "one-way latency (µs)", "latency.png",
             "MPI ping-pong latency per hierarchy level"),
            ("bw", "bandwidth_MBps", "bandwidth (MB/s)", "bandwidth.png",
             "MPI streaming bandwidth per hierarchy level")):
        fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
        for label, lv, transport, recs in _curves(doc, test):
            style, marker = TRANSPORT_STYLES.get(transport, ("-", "x"))
            ax.errorbar([r["size"] for r in recs], [r[key] for r in recs],
                        yerr=_bars(recs, key), linestyle=style,
                        marker=marker, markersize=4, capsize=2,
                        elinewidth=0.8, color=LEVEL_COLOURS.get(lv, "grey"),
                        label=label)
        ax.set_yscale("log")
        _size_axis(ax, sizes)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        # the corner the curves leave free: latency rises to the right,
        # bandwidth starts low on the left
        ax.legend(fontsize=7, loc="lower right" if test == "latency"
                  else "upper left")
        written.append(_save(plt, fig, out / name))
    return written


def plot_halo(plt, doc: Dict, out: Path) -> List[Path]:
    summ = doc.get("summary") or {}
    if not summ:
        return []
    names = list(summ)
    fig, ax = plt.subplots(figsize=(5.5, 4.2), dpi=120)
    xs = range(len(names))
    medians = [summ[n]["wall_s"] for n in names]
    ax.bar(xs, medians, width=0.55,
           color=[PLACEMENT_COLOURS.get(n, "grey") for n in names],
           alpha=0.8, label="median")
    for x, n in zip(xs, names):
        runs = summ[n]["runs"]
        ax.plot([x] * len(runs), runs, "k.", markersize=6,
                label="runs" if x == 0 else None)
        ax.vlines(x, min(runs), max(runs), colors="black", linewidth=0.8,
                  label="min..max" if x == 0 else None)
        ax.annotate(f"{summ[n]['wall_s']:.2f} s", (x, summ[n]["wall_s"]),
                    textcoords="offset points", xytext=(0, 4), ha="center",
                    fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{n}\n{summ[n]['cut']['across_servers']:g} of "
                        f"{sum(summ[n]['cut'].values()):g} grid edges\n"
                        f"across servers" for n in names], fontsize=8)
    ax.set_ylabel("wall time (s)")
    ax.set_ylim(0, max(max(s["runs"]) for s in summ.values()) * 1.2)
    t = (doc.get("targets") or [{}])[0]
    ratio = (f"; round-robin / planned = {t['value']:.2f}"
             if t.get("value") is not None else "")
    ax.set_title(f"{doc['ranks']}-rank halo exchange ({doc['pattern']}, "
                 f"{fmt_size(doc['face_bytes'])} faces, {doc['iters']} "
                 f"iterations),\nuplinks {doc['cluster']['uplink_rate']}, "
                 f"{doc['transport']}{ratio}", fontsize=9)
    ax.legend(fontsize=8)
    return [_save(plt, fig, out / "halo.png")]


def plot_apps(plt, doc: Dict, out: Path) -> List[Path]:
    written = []
    rel = [r for r in doc["relative"]
           if r["tcp_vs_one"] is not None or r["ivshmem_vs_one"] is not None]
    if rel:
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
        xs = range(len(rel))
        for off, key, label, colour in (
                (-0.2, "tcp_vs_one", "two instances, tcp", "#d62728"),
                (0.2, "ivshmem_vs_one", "two instances, ivshmem",
                 "#1f77b4")):
            if all(r[key] is None for r in rel):
                continue        # not run (bench apps --configs)
            ran = [r for r in rel if r[key] is not None]
            ax.bar([x + off for x, r in zip(xs, rel) if r[key] is not None],
                   [r[key] for r in ran], width=0.4, label=label,
                   color=colour, yerr=_bars(ran, key, f"{key}_worst",
                                            f"{key}_best"),
                   error_kw={"elinewidth": 0.8, "capsize": 3})
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([doc["metrics"][f"{r['app']}:{r['metric']}"]
                            ["label"] for r in rel], rotation=30,
                           ha="right", fontsize=8)
        ax.set_ylabel("speed relative to one instance")
        ax.set_title("Applications, 2 ranks: 1.0 = both ranks in one "
                     "instance (bare metal);\nbars: medians, whiskers: "
                     "the worst and best the runs allow", fontsize=10)
        ax.legend(fontsize=8)
        written.append(_save(plt, fig, out / "apps.png"))
    cpus = _scaling_cpus(doc)
    views = [(s, scaling_view(s, cpus)) for s in doc.get("scaling", [])]
    views = [(s, v) for s, v in views if v["table"]]
    if views:
        fig, ax = plt.subplots(figsize=(6, 4.5), dpi=120)
        top = max(r["ranks"] for _, v in views for r in v["rows"])
        ax.plot([1, top], [1, top], color="grey", linestyle=":",
                label="ideal")
        for s, v in views:
            rows = v["rows"]
            ax.errorbar([r["ranks"] for r in rows],
                        [r["speedup"] or 0 for r in rows],
                        yerr=_bars(rows, "speedup"), marker="o",
                        capsize=3, label=f"{s['app']}")
            f = v["fit"]
            if f is not None:
                ps = range(1, top + 1)
                ax.plot(list(ps), [1 / (f + (1 - f) / p) for p in ps],
                        linestyle="--", linewidth=0.8,
                        label=f"{s['app']} Amdahl, f = {f:.2f}")
        ax.set_xticks(sorted({r["ranks"] for _, v in views
                              for r in v["rows"]}))
        ax.set_xlabel("ranks")
        ax.set_ylabel("speed-up S = T1 / Tp (min..max of the rounds)")
        ax.set_title(f"Strong scaling on the 3-level cluster (ivshmem), "
                     f"up to the host's {cpus} CPUs", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
        written.append(_save(plt, fig, out / "speedup.png"))
    return written


def _scaling_cpus(doc: Dict) -> int:
    """The CPUs the scaling series' ranks could use: what the run
    recorded (its affinity), else the host's count."""
    return int(doc.get("scaling_cpus") or doc.get("cpus") or 1)


# ---------------------------------------------------------------- markdown

def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]],
              left: int = 1) -> List[str]:
    align = ["---"] * left + ["---:"] * (len(header) - left)
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _targets_and_notes(doc: Dict) -> List[str]:
    """A document's closing sections: its targets, then its notes."""
    rows = [[t["name"], "n/a" if t["value"] is None else f"{t['value']:.3g}",
             f"{t['op']} {t['threshold']:g}",
             t["status"] + (f" ({spread_note(t['best'])})"
                            if t.get("within_spread") else "")]
            for t in doc["targets"]]
    lines = ["", "### Targets", ""] + _md_table(
        ["target (ratio from this run)", "value", "wanted", "status"], rows)
    if doc.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in doc["notes"]]
    return lines


def _setup(doc: Dict, title: str, kernel: bool = False,
           more: str = "") -> List[str]:
    """A section's title, its paragraph on when, where and on which
    cluster the run was (then `more`), and the machine's load."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(doc["started"]))
    cpus = f"{doc['cpus']} CPUs" + (f", kernel {doc['kernel']}" if kernel
                                     else "")
    return [title, "", f"{when} on {doc['host']} ({cpus})"
            f"{', quick run' if doc.get('quick') else ''}. Cluster: "
            f"{_cluster_line(doc['cluster'])}.{more}"] + _load_lines(doc)


def _load_lines(doc: Dict) -> List[str]:
    """A section's line on the machine's load: a warning when busy."""
    load = doc.get("load") or {}
    reasons = busy_reasons(load)
    if reasons:
        return ["", f"**Warning: {busy_warning(reasons)}.**"]
    before = load.get("before")
    if not before:
        return []
    return ["", f"The machine was quiet before and after the run (other "
                f"processes used {100 * before['cpu_share']:.0f} % of the "
                f"CPUs' time before, steal "
                f"{100 * before['steal_share']:.0f} %)."]


def guest_title(accel: Optional[str]) -> str:
    """What a VM cluster's figures are: under TCG emulation speed."""
    why = ("emulated CPUs: absolute figures are not performance claims, "
           "compare the ratios" if accel == "tcg"
           else "hardware virtualisation")
    return f"instances: QEMU guests under {str(accel).upper()} ({why})"


def _cluster_line(c: Dict) -> str:
    rate = c.get("uplink_rate")
    vcpus = c["servers"] * c["instances_per_server"] * c["vcpus"]
    over = " (oversubscribed)" if vcpus > c["host_cpus"] else ""
    line = (f"{c['servers']} servers x {c['instances_per_server']} "
            f"instances x {c['vcpus']} vCPUs on {c['host_cpus']} host CPUs"
            f"{over}, uplinks "
            f"{'limited to ' + rate if rate else 'unshaped'}")
    if c.get("instance_kind") == "vm":
        line += f"; {guest_title(c.get('accel'))}"
    return line


def hierarchy_md(doc: Dict, images: Sequence[str]) -> List[str]:
    recs = doc["records"]
    lines = _setup(doc, "## Communication hierarchy: `ivcloud bench "
                        "hierarchy`", kernel=True) + [
             "",
             "mpi-osu, 2 ranks placed by a rankfile; one-way latency = half "
             "a round trip, bandwidth = a window of non-blocking sends per "
             "ack; each job's figure the median of 5 batches, and each "
             f"figure here the median of {doc.get('rounds', 1)} round(s) in "
             "which the levels and transports alternate.", ""]
    for lv in doc["levels"]:
        lines.append(f"- **L{lv['level']} {lv['name']}**: {lv['what']} "
                     f"({' + '.join(lv['hosts'])})")
    lines.append("")
    lines += [f"![{Path(i).stem}]({i})" for i in images]
    if recs:
        for test, title in (("latency", "One-way latency (µs)"),
                            ("bw", "Bandwidth (MB/s)")):
            header, rows = hierarchy_table(recs, test,
                                           doc["transports"])
            lines += ["", f"### {title}", ""] + _md_table(header, rows)
    return lines + _targets_and_notes(doc)


def halo_md(doc: Dict, images: Sequence[str]) -> List[str]:
    lines = _setup(doc, "## Rank placement: `ivcloud bench halo`") + [
             "",
             f"mpi-halo: {doc['ranks']} ranks on a {doc['dims'][0]}x"
             f"{doc['dims'][1]} grid, {fmt_size(doc['face_bytes'])} per "
             f"face and neighbour, {doc['iters']} timed iterations, "
             f"transport {doc['transport']}, {doc['reps']} run(s) per "
             f"placement alternating; wall time = slowest rank. *planned* "
             f"is the rankfile of `ivcloud place --pattern {doc['pattern']}`"
             f" ({doc['partitioner']}), *round-robin* Open MPI's "
             f"`--map-by node` over the instances.", ""]
    lines += [f"![{Path(i).stem}]({i})" for i in images]
    summ = doc.get("summary") or {}
    if summ:
        header, rows = halo_table(summ)
        lines += [""] + _md_table(header, rows)
        lines += ["", "Where the ranks ran:", ""]
        lines += [f"- {n}: {' '.join(s['hosts'])}" for n, s in summ.items()]
    lines += ["", "Planned rankfile (`ivcloud place`; the job ran it with "
              "each rank's slot widened to its instance's vCPUs, as "
              "Open MPI binds a rankfile's ranks to their slots while "
              "round-robin ranks float):", "", "```"] + doc["rankfile"] + \
        ["```"]
    return lines + _targets_and_notes(doc)


def apps_md(doc: Dict, images: Sequence[str]) -> List[str]:
    c = doc["configs"]
    lines = _setup(doc, "## Applications: `ivcloud bench apps`", more=(
        f" Configurations of 2 ranks: *one* = both in one instance "
        f"({' + '.join(c['one'])}, Open MPI's shared memory: the bare-metal "
        f"reference), *tcp* and *ivshmem* = one rank in each of two "
        f"instances ({' + '.join(c['ivshmem'])}). "
        + ("HPCC also ran as *one, 2 copies*: one instance without "
           "Open MPI's single-copy mechanism (CMA), so every message "
           "is copied into shared memory and out again, as on any "
           "path between VMs. "
           if any(r["config"] == "one-twocopy" for r in doc["records"])
           else "")
        + f"{doc['rounds']} round(s), the configurations alternating; "
        f"figures are medians (min..max). HPCC N = {doc['hpcc_n']}; "
        f"OpenFOAM simpleFoam on pitzDaily, {doc['foam_iterations']} "
        f"iterations (its ExecutionTime).")) + [""]
    lines += [f"![{Path(i).stem}]({i})" for i in images]
    header, rows = apps_table(doc)
    if rows:
        lines += [""] + _md_table(header, rows, left=2)
    cpus = _scaling_cpus(doc)
    for series in doc.get("scaling", []):
        header, rows, notes = scaling_table(series, cpus)
        lines += ["", f"### Strong scaling: {series['app']}", "",
                  "ivshmem on the 3-level cluster "
                  f"({_cluster_line(doc['scaling_cluster'])}), block "
                  "placement; T median of the rounds (min..max), "
                  "S = T1/Tp (the extremes of the rounds), E = S/p."]
        if rows:
            lines += [""] + _md_table(header, rows)
        lines += [""] + [f"- {n}" for n in notes]
    return lines + _targets_and_notes(doc)


# ---------------------------------------------------------------- driver

# the cloud benchmarks in the report's order: the document's name, its
# section of report.md, its plots
SECTIONS = (("hierarchy", hierarchy_md, plot_hierarchy),
            ("halo", halo_md, plot_halo), ("apps", apps_md, plot_apps))


def write(out: Path) -> Path:
    """Plots and report.md from the JSON documents in `out`; the path of
    report.md. ReportError if there is nothing to report, or (after
    report.md is written) if the plots could not be drawn."""
    out = Path(out)
    docs = {name: _load(out / f"{name}.json") for name, _, _ in SECTIONS}
    if all(doc is None for doc in docs.values()):
        raise ReportError(f"no hierarchy.json, halo.json or apps.json in "
                          f"{out}")
    problem = None
    images: Dict[str, List[str]] = {name: [] for name in docs}
    try:
        plt = _pyplot()
    except ReportError as e:
        problem = str(e)
    else:
        for name, _, plot in SECTIONS:
            if docs[name] is not None:
                images[name] = [p.name for p in plot(plt, docs[name], out)]
    lines = ["# ivcloud: MPI on an emulated cloud", "",
             "Generated by `ivcloud bench report` from the JSON in this "
             "directory. The machine is small and shared: compare ratios "
             "within one run, not across runs.", ""]
    if problem:
        lines += [f"**{problem}**", ""]
    were_busy = [d["benchmark"] for d in docs.values()
                 if d is not None and busy_reasons(d.get("load"))]
    if were_busy:
        lines += [f"**Warning: the machine was busy during `bench "
                  f"{'`, `bench '.join(were_busy)}`** (the sections say "
                  f"how busy): figures taken then are noise as much as "
                  f"measurement.", ""]
    for name, section, _ in SECTIONS:
        if docs[name] is not None:
            lines += section(docs[name], images[name]) + [""]
        else:
            lines += [f"(no {name}.json: run `ivcloud bench {name}`)", ""]
    md = out / "report.md"
    md.write_text("\n".join(lines))
    if problem:
        raise ReportError(problem)
    return md


def publish(name: str, doc: Dict, out: Path,
            json_path: Optional[Path] = None, failed: bool = False,
            stdout=None, redo_report: bool = True) -> int:
    """A cloud benchmark's end: its document written to OUT/<name>.json
    (and `json_path`), the report redone from every document in `out`;
    the exit status (1 if the run or the report failed)."""
    out = Path(out)
    paths = {out / f"{name}.json"}
    if json_path:
        paths.add(Path(json_path))
    write_docs(doc, sorted(paths), stdout)
    if not redo_report:
        return 1 if failed else 0
    try:
        md = write(out)
    except ReportError as e:
        print(f"report: {e}", file=sys.stderr)
        return 1
    print(f"report: {md}", file=stdout or sys.stdout)
    return 1 if failed else 0
