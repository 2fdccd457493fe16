"""The chaos run's timeline as a PNG: above, the tokens per second the clients received and
their failed requests per second; below, one row per fault kind, each fault from its
injection to the server's next correct answer, its detection marked, and the attempts
torchrun started.

    python benchmarks/chaos_plot.py RECORD.json OUT.png
"""

from __future__ import annotations

import json
import sys
from typing import Any

from chaos_schedule import KINDS

COLORS = {"sigkill": "tab:red", "sigstop_short": "tab:olive", "sigstop_long": "tab:orange",
          "idle_gap": "tab:blue", "burst": "tab:purple", "disconnect": "tab:cyan"}


def plot(rec: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = rec["timeline"]
    tokens, errors = tl["tokens_per_s"], tl["errors_per_s"]
    minutes = [s / 60 for s in range(len(tokens))]
    fig, (top, low) = plt.subplots(2, 1, figsize=(14, 7), sharex=True,
                                   gridspec_kw={"height_ratios": [3, 2]})
    # a 5 s moving average: a step's tokens arrive in bursts
    smooth = [sum(tokens[max(0, s - 4):s + 1]) / len(tokens[max(0, s - 4):s + 1])
              for s in range(len(tokens))]
    top.plot(minutes, smooth, lw=0.8, color="tab:green", label="tokens/s received (5 s mean)")
    top.set_ylabel("tokens/s")
    err = top.twinx()
    err.bar(minutes, errors, width=1 / 60, color="tab:red", alpha=0.5,
            label="failed requests/s")
    err.set_ylabel("failed requests/s")
    for t in tl["attempt_starts"][1:]:
        top.axvline(t / 60, color="grey", lw=0.5, ls=":")
    for t in tl["serving_again"]:
        top.axvline(t / 60, color="tab:green", lw=0.5, ls="--")
    top.set_title(f"chaos run, seed {rec['seed']}: {len(rec['faults'])} faults, "
                  f"{len(tl['attempt_starts']) - 1} restarts; {rec['machine']['cpu']}, "
                  f"{rec['machine']['cores']} cores")
    h1, l1 = top.get_legend_handles_labels()
    h2, l2 = err.get_legend_handles_labels()
    top.legend(h1 + h2 + [plt.Line2D([], [], color="grey", ls=":"),
                          plt.Line2D([], [], color="tab:green", ls="--")],
               l1 + l2 + ["attempt started", "serving again after a restart"],
               loc="upper right", fontsize=8)
    rows = {k: i for i, k in enumerate(KINDS)}
    for f in rec["faults"]:
        if f.get("t_inject") is None:
            continue
        y, t0 = rows[f["kind"]], f["t_inject"] / 60
        if f.get("t_recovered") is None and f.get("superseded") is None and (
                f.get("gave_up") or f.get("stopped")):  # never answered again: to the end
            end = rec["end"].get("t") or len(tokens)
            low.plot([t0, end / 60], [y, y], color=COLORS[f["kind"]], lw=5, alpha=0.35,
                     solid_capstyle="butt")
            low.plot([end / 60], [y], "r>", ms=7)
        else:
            t1 = (f.get("t_recovered") or f.get("t_end") or f["t_inject"]) / 60
            low.plot([t0, t1], [y, y], color=COLORS[f["kind"]], lw=5, solid_capstyle="butt")
        if f.get("detected_s") is not None:
            low.plot([t0 + f["detected_s"] / 60], [y], "kx", ms=6)
    low.plot([], [], "kx", label="detected (log)")
    low.plot([], [], "r>", label="no correct answer again")
    low.set_yticks(range(len(KINDS)), KINDS)
    low.set_ylim(-0.7, len(KINDS) - 0.3)
    low.set_xlabel("minutes since torchrun started")
    low.legend(loc="upper right", fontsize=8)
    low.set_title("each fault: injection to the next correct answer", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    plot(json.loads(open(sys.argv[1]).read()), sys.argv[2])
