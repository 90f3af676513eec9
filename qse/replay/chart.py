"""One PNG of a replay: how far behind the reader was at turn starts, why it missed, and where its time went."""

from __future__ import annotations

from pathlib import Path

from qse.replay.simulator import SimResult

INSTALL_HINT = "pip install 'qse[plot]' (or matplotlib) and run the same command again"


class ChartUnavailable(RuntimeError):
    """The chart cannot be drawn here (matplotlib is not installed); the report does not need it."""


def write_chart(result: SimResult, out_dir: Path | str, name: str = "replay.png", title: str = "") -> Path:
    try:
        import matplotlib
    except ImportError:
        raise ChartUnavailable(f"matplotlib is not installed, so no {name} was drawn; {INSTALL_HINT}") from None

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = result.report()
    grid = result.options.grid
    behind = sorted(s.behind_tokens for s in result.turn_starts if s.turn > 0) or \
        sorted(s.behind_tokens for s in result.turn_starts)

    fig, (ax0, ax2, ax1) = plt.subplots(1, 3, figsize=(15, 4.2))
    if behind:
        n = len(behind)
        ax0.step([max(b, 1) for b in behind], [(i + 1) / n for i in range(n)], where="post")
        ax0.axvline(grid, color="tab:red", linestyle="--", label=f"one grid chunk ({grid})")
        ax0.set_xscale("log")
        ax0.legend(loc="lower right")
    fresh = report["fresh_share_followups"] if report["fresh_share_followups"] is not None else report["fresh_share"]
    ax0.set_title(f"tokens behind at turn start (fresh {100 * (fresh or 0):.1f} %)")
    ax0.set_xlabel("tokens behind (log; 0 drawn at 1)")
    ax0.set_ylabel("share of follow-up turn starts")
    ax0.grid(alpha=0.3)

    by_cause = report["misses"]["by_cause"]
    labels = [c.replace("rollback_", "rb ").replace("backlog_", "bl ").replace("_checkpoint", " ckpt").replace("_", " ")
              for c in by_cause]
    ax2.barh(labels, [v["n"] for v in by_cause.values()],
             color=["tab:red" if c.startswith("rollback") else "tab:blue" for c in by_cause])
    ax2.invert_yaxis()
    ax2.set_title(f"missed follow-up turn starts by cause ({report['misses']['num_missed']})")
    ax2.set_xlabel("turn starts")
    ax2.tick_params(axis="y", labelsize=8)
    ax2.grid(axis="x", alpha=0.3)

    reader = report["reader_ms"]
    names = ["idle", "ration", "prefill"]
    ax1.bar(names, [reader[k] / 1000 for k in names], color=["tab:green", "tab:orange", "tab:purple"])
    loss = report["decode_loss"]
    ax1.set_title(f"reader time by window (decode loss {100 * (loss or 0):.2f} %)")
    ax1.set_ylabel("seconds")
    ax1.grid(axis="y", alpha=0.3)

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = out_dir / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
