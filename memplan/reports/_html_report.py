"""``OUT/report.html``: one self-contained page about a run, written at the end of fit/train.

It reads what the run left in OUT — ``plan.json``, ``summary.json``, ``metrics.jsonl`` and,
when ``memplan doctor --out OUT`` ran, ``doctor.json`` — and draws its charts as inline SVG
(``memplan.reports._svg``): no script, no stylesheet or font fetched, so it opens offline.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from estimators import format_size

from ._svg import Series, bar_chart, line_chart

__all__ = ["write_report", "render_report", "REPORT_FILE"]

REPORT_FILE = "report.html"

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1180px;color:#222}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;font-size:13px;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f4f4f4}td.l,th.l{text-align:left}tr.chosen{background:#fff4e0;font-weight:bold}
.charts{display:flex;flex-wrap:wrap;gap:12px}.note{color:#666;font-size:12px}
.error{color:#b00020}.warning{color:#a05a00}.info{color:#555}
"""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    records = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a crash
    return records


def _num(v: Any) -> float | None:
    if isinstance(v, str):
        v = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(v)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _config_text(c: Mapping[str, Any]) -> str:
    layout = "" if c.get("strategy", "single") == "single" else f", {c['strategy']} x{c.get('world_size')}"
    return (
        f"micro-batch {c.get('micro_batch_size')} x{c.get('grad_accum_steps')} accumulation, "
        f"{c.get('precision')}, {c.get('checkpoint_segments')} checkpointed blocks{layout}"
    )


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, left: int = 0, marked: int | None = None) -> str:
    head = "".join(f'<th class="{"l" if i < left else ""}">{escape(str(h))}</th>' for i, h in enumerate(headers))
    body = []
    for r, row in enumerate(rows):
        cells = "".join(f'<td class="{"l" if i < left else ""}">{escape(str(v))}</td>' for i, v in enumerate(row))
        body.append(f'<tr class="{"chosen" if r == marked else ""}">{cells}</tr>')
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _plan_section(plan: Mapping[str, Any] | None, summary: Mapping[str, Any] | None) -> str:
    if not plan:
        return "<h2>Plan</h2><p class='note'>no plan.json in this folder</p>"
    rows = []
    for k, e in enumerate(plan.get("entries", [])[:15], 1):
        c, pred, meas = e["config"], e["predicted"], e.get("measured")
        rows.append(
            [
                k,
                c["micro_batch_size"],
                c["grad_accum_steps"],
                c["precision"],
                c["checkpoint_segments"],
                c.get("strategy", "single"),
                format_size(pred["peak_allocated_bytes"]),
                format_size(meas["peak_allocated_bytes"]) if meas else "-",
                f"{e['samples_per_s']:,.1f}",
                # What the samples/s is (one basis for the plan: memplan.planning._plan.BASES);
                # a plan file written before the basis was kept says measured or predicted.
                (e.get("basis") or ("measured" if meas else "predicted"))
                + (f" (probe {e['probe_status']})" if e.get("probe_status") not in (None, "ok") else ""),
            ]
        )
    target = plan.get("gpu") or plan.get("device")
    head = (
        f"<h2>Plan</h2><p>for <b>{escape(str(target))}</b>, budget {format_size(plan['budget_bytes'])} "
        f"(margin {plan['margin']:.0%}); {len(plan.get('entries', []))} feasible of {plan.get('trials')} "
        "configurations estimated. Row 1 is the chosen configuration.</p>"
    )
    table = _table(
        [
            "#",
            "micro",
            "accum",
            "precision",
            "ckpt",
            "strategy",
            "predicted peak",
            "measured peak",
            "samples/s",
            "basis",
        ],
        rows,
        marked=0,
    )
    trained = ""
    if summary and summary.get("config") and plan.get("entries"):
        chosen = plan["entries"][0]["config"]
        ran = summary["config"]
        trained = f"<p>Chosen: <b>{escape(_config_text(chosen))}</b>.</p>"
        if ran != chosen:
            trained += f"<p>Trained last: <b>{escape(_config_text(ran))}</b> (after an out-of-memory switch).</p>"
    notes = "".join(f"<p class='note'>note: {escape(n)}</p>" for n in plan.get("notes", []))
    return head + trained + table + notes


def _memory_section(summary: Mapping[str, Any] | None, steps: list[dict[str, Any]], budget: int | None) -> str:
    if not summary:
        return ""
    predicted, measured = summary.get("predicted_peak_bytes"), summary.get("peak_memory_bytes")
    peaks = [("predicted peak", predicted), ("measured peak", measured)]
    top = max([v for _, v in peaks if v] or [0])
    # A budget far above the peaks would flatten their bars: it is drawn only when comparable.
    shown = peaks + ([("budget", budget)] if budget and budget <= 5 * top else [])
    bars = [(label, float(v), format_size(int(v))) for label, v in shown if v]
    ratio = summary.get("peak_over_predicted")
    text = f"<p>measured / predicted: <b>{ratio:.3f}</b>" if isinstance(ratio, (int, float)) else "<p>"
    text += f"; budget {format_size(int(budget))}</p>" if budget else "</p>"
    charts = [bar_chart(bars, title="peak memory: predicted against measured")]
    xs = [r["step"] for r in steps]
    by_step = [_num(r.get("peak_memory_bytes")) for r in steps]
    if any(p for p in by_step):
        hl = [("predicted peak", float(predicted))] if predicted else []
        charts.append(
            line_chart(
                [Series("measured peak", xs, [p / 1e6 if p else None for p in by_step])],
                title="measured peak memory by step",
                xlabel="step",
                ylabel="MB",
                hlines=[(n, v / 1e6) for n, v in hl],
            )
        )
    return "<h2>Memory</h2>" + text + "<div class='charts'>" + "".join(charts) + "</div>"


def _curves_section(steps: list[dict[str, Any]], evals: list[dict[str, Any]]) -> str:
    xs = [r["step"] for r in steps]
    charts = [
        line_chart(
            [
                Series("train loss", xs, [_num(r.get("loss")) for r in steps]),
                *(
                    [Series("val loss", [r["step"] for r in evals], [_num(r.get("val_loss")) for r in evals])]
                    if evals
                    else []
                ),
            ],
            title="loss",
            xlabel="step",
        )
    ]
    metric_keys = sorted(
        {k for r in evals for k in r if k.startswith("val_") and k != "val_loss" and _num(r.get(k)) is not None}
    )
    for key in metric_keys:
        charts.append(
            line_chart(
                [Series(key, [r["step"] for r in evals], [_num(r.get(key)) for r in evals])],
                title=key.replace("_", " "),
                xlabel="step",
            )
        )
    charts.append(
        line_chart(
            [Series("learning rate", xs, [_num(r.get("lr")) for r in steps])], title="learning rate", xlabel="step"
        )
    )
    charts.append(
        line_chart(
            [Series("samples/s", xs, [_num(r.get("samples_per_s")) for r in steps])],
            title="throughput",
            xlabel="step",
            ylabel="samples/s",
        )
    )
    norms = [r for r in steps if isinstance(r.get("layer_grad_norms"), dict)]
    if norms:
        layers = list(norms[-1]["layer_grad_norms"])[:10]
        charts.append(
            line_chart(
                [
                    Series(name, [r["step"] for r in norms], [_num(r["layer_grad_norms"].get(name)) for r in norms])
                    for name in layers
                ],
                title="gradient norm per layer",
                xlabel="step",
                log_y=True,
            )
        )
    gpu = [
        (k, t)
        for k, t in (
            ("gpu_util_percent", "GPU utilisation (%)"),
            ("gpu_power_watts", "GPU power (W)"),
            ("gpu_temperature_c", "GPU temperature (C)"),
        )
        if any(k in r for r in steps)
    ]
    for key, title in gpu:
        charts.append(line_chart([Series(key, xs, [_num(r.get(key)) for r in steps])], title=title, xlabel="step"))
    return "<h2>Training curves</h2><div class='charts'>" + "".join(charts) + "</div>"


def _oom_section(records: list[dict[str, Any]], summary: Mapping[str, Any] | None) -> str:
    events = [r for r in records if r.get("type") == "oom_recovery"] or list((summary or {}).get("recoveries", []))
    if not events:
        return "<h2>Out-of-memory switches</h2><p>none: the chosen configuration ran to the end.</p>"
    rows = []
    for e in events:
        frm, to = e.get("from"), e.get("to")
        rows.append(
            [
                e.get("step"),
                e.get("phase", ""),
                _config_text(frm) if isinstance(frm, dict) else frm,
                _config_text(to) if isinstance(to, dict) else to,
                f"{_num(e.get('seconds')) or 0:.2f} s",
            ]
        )
    return "<h2>Out-of-memory switches</h2>" + _table(["step", "phase", "from", "to", "recovery"], rows, left=4)


def _doctor_section(doctor: Mapping[str, Any] | None) -> str:
    if not doctor:
        return ""
    findings = doctor.get("findings", [])
    state = "healthy" if doctor.get("healthy") else "findings to look at"
    rows = [[f["severity"], f["check"], f"{f['title']}: {f['detail']}", f["cause"], f["fix"]] for f in findings]
    table = _table(["severity", "check", "finding", "likely cause", "fix"], rows, left=5) if rows else ""
    return f"<h2>Doctor</h2><p>memplan doctor: <b>{state}</b> ({len(findings)} notes)</p>{table}"


def render_report(out_dir: str | Path) -> str:
    """The report's HTML for the run in ``out_dir``."""
    out = Path(out_dir)
    plan = _read_json(out / "plan.json")
    summary = _read_json(out / "summary.json")
    doctor = _read_json(out / "doctor.json")
    records = _read_metrics(out / "metrics.jsonl")
    steps = [r for r in records if r.get("type") == "step" and isinstance(r.get("step"), int)]
    evals = [r for r in records if r.get("type") == "eval" and isinstance(r.get("step"), int)]
    task = (summary or {}).get("task", out.name)
    final = ", ".join(
        f"{k} {v:.4g}" for k, v in ((summary or {}).get("final_metrics") or {}).items() if isinstance(v, (int, float))
    )
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = (
        f"<h1>memplan run: {escape(str(task))}</h1><p class='note'>written {when}; device "
        f"{escape(str((summary or {}).get('device', '?')))}, torch {escape(str((summary or {}).get('torch', '?')))}; "
        f"{(summary or {}).get('steps', len(steps))} steps in {(summary or {}).get('wall_s', 0):.1f} s"
        f"{'; ' + escape(final) if final else ''}</p>"
    )
    body = [
        head,
        _plan_section(plan, summary),
        _memory_section(summary, steps, plan.get("budget_bytes") if plan else None),
        _curves_section(steps, evals),
        _oom_section(records, summary),
        _doctor_section(doctor),
    ]
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>memplan run report</title>"
        f"<style>{_CSS}</style></head><body>{''.join(body)}</body></html>"
    )


def write_report(out_dir: str | Path) -> Path:
    """Write ``out_dir/report.html`` and return its path."""
    path = Path(out_dir) / REPORT_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_report(out_dir), encoding="utf-8")
    tmp.replace(path)
    return path
