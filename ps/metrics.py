"""Per-iteration metrics as JSONL, and the end-of-run summary table."""

from __future__ import annotations

import json
import math
import numbers
import statistics
from typing import Iterable


class MetricsLog:
    """Appends one JSON object per line (flushed, so a crash keeps what was written)."""

    def __init__(self, path: str | None):
        self.path = path
        self._f = open(path, "a", buffering=1) if path else None
        self.rows: list[dict] = []

    def write(self, row: dict) -> None:
        self.rows.append(row)
        if self._f is not None:
            self._f.write(json.dumps(row, default=_jsonable) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _jsonable(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def strict_json(x):
    """``x`` with every non-finite float (NaN, inf) as None and numbers as plain floats: what standard JSON
    parsers accept (``json.dump`` would write bare ``NaN``). Mappings and sequences are walked."""
    if isinstance(x, dict):
        return {str(k): strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, numbers.Integral):  # numpy integers too
        return int(x)
    v = _jsonable(x)
    return v if not isinstance(v, float) or math.isfinite(v) else None


def write_summary_json(path: str, summary: dict) -> None:
    """The end-of-run summary as standard JSON (an unmeasured figure, e.g. MLfabric's batch sync, is null)."""
    with open(path, "w") as f:
        json.dump(strict_json(summary), f, allow_nan=False)


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _pct(values, q):
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(math.ceil(q * len(v))) - 1)]


def sync_s(row: dict) -> float | None:
    """An iteration row's batch synchronisation time (gather + broadcast, seconds); None where the mode has no
    such round (``gather_s`` None: MLfabric's dynamic updates arrive through aggregators, timed by nobody, and
    Hoplite's asynchronous updates apply as gradients come).  ``broadcast_s`` None: the round has no broadcast
    timed apart (an all-reduce has none; a tree's program carries the parameters down inside ``gather_s``)."""
    g, b = row.get("gather_s"), row.get("broadcast_s")
    return None if g is None else g + (b or 0.0)


def summarize(rows: Iterable[dict]) -> dict:
    iters = [r for r in rows if r.get("event") == "iteration"]
    epochs = [r for r in rows if r.get("event") == "epoch"]
    timed = [r for r in iters if sync_s(r) is not None]
    sync = [sync_s(r) for r in timed]
    fr = [f for r in iters for f in r.get("delivered", {}).values()]
    out = {
        "iterations": len(iters),
        "sync_mean_s": statistics.fmean(sync) if sync else float("nan"),
        "sync_p50_s": _pct(sync, 0.5),
        "sync_p99_s": _pct(sync, 0.99),
        "gather_mean_s": statistics.fmean(r["gather_s"] for r in timed) if timed else float("nan"),
        "broadcast_mean_s": statistics.fmean(b) if (b := [r["broadcast_s"] for r in timed
                                                           if r.get("broadcast_s") is not None]) else float("nan"),
        "delivered_mean": statistics.fmean(fr) if fr else float("nan"),
        "delivered_min": min(fr) if fr else float("nan"),
        "final_accuracy": epochs[-1].get("accuracy") if epochs else None,
        "best_accuracy": max((e["accuracy"] for e in epochs if e.get("accuracy") is not None), default=None),
        "wall_s": (iters[-1]["t"] - iters[0]["t"]) if len(iters) > 1 else 0.0,
    }
    return out


def epoch_loss(rows: list[dict], reports_loss: bool = True) -> float:
    """The mean training loss of an epoch's round rows, those that carry one (not NaN); NaN where none does, or
    where the workload has no loss (``Workload.reports_loss`` False: its 0.0 is a placeholder)."""
    losses = [r["loss"] for r in rows if r["loss"] == r["loss"]]
    return statistics.fmean(losses) if reports_loss and losses else float("nan")


def figure(x, spec: str) -> str:
    """``format(x, spec)``, or '-' where nothing was measured (None or NaN)."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_summary(s: dict, title: str = "summary") -> str:
    f = figure
    lines = [f"== {title} ==",
             f"{'iterations':<22}{s['iterations']}",
             f"{'batch sync mean':<22}{f(s['sync_mean_s'] * 1e3, '.2f')} ms  (gather {f(s['gather_mean_s'] * 1e3, '.2f')} ms, "
             f"broadcast {f(s['broadcast_mean_s'] * 1e3, '.2f')} ms)",
             f"{'batch sync p50/p99':<22}{f(s['sync_p50_s'] * 1e3, '.2f')} / {f(s['sync_p99_s'] * 1e3, '.2f')} ms",
             f"{'delivered fraction':<22}mean {f(s['delivered_mean'], '.4f')}, min {f(s['delivered_min'], '.4f')}",
             f"{'final / best accuracy':<22}{f(s['final_accuracy'], '.4f')} / {f(s['best_accuracy'], '.4f')}",
             f"{'wall time':<22}{f(s['wall_s'], '.1f')} s"]
    return "\n".join(lines)
